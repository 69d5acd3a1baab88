{{/* Observability: scrape annotations, log format and OpenTelemetry variables (values: observability). */}}

{{- define "kubeon.scrapeAnnotations" -}}
{{- if .Values.observability.metrics.scrapeAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: "8080"
prometheus.io/path: /metrics
{{- end }}
{{- end -}}

{{/* Environment of a container: KUBEON_LOG_FORMAT when json; with tracing (the worker's), the OTEL_* variables. */}}
{{- define "kubeon.observabilityEnv" -}}
{{- $o := .root.Values.observability }}
{{- if eq $o.logFormat "json" }}
- name: KUBEON_LOG_FORMAT
  value: json
{{- end }}
{{- if and .tracing $o.tracing.otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $o.tracing.otlpEndpoint | quote }}
- name: OTEL_SERVICE_NAME
  value: {{ $o.tracing.serviceName | quote }}
- name: OTEL_TRACES_SAMPLER
  value: parentbased_traceidratio
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ $o.tracing.sampleRatio | toString | quote }}
{{- with $o.tracing.resourceAttributes }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- end -}}
