{{/*
Names are fixed, not prefixed with the release name: one optimizer per cluster (R1.1), and the documented
commands (kubectl -n kubeon-gpu get deploy kubeon-gpu-optimizer) and ClusterRole name must hold.
*/}}
{{- define "kubeon.name" -}}kubeon-gpu-optimizer{{- end -}}
{{- define "kubeon.gatewayName" -}}kubeon-gpu-optimizer-gateway{{- end -}}
{{- define "kubeon.temporalName" -}}kubeon-gpu-optimizer-temporal{{- end -}}

{{- define "kubeon.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kubeon.labels" -}}
helm.sh/chart: {{ include "kubeon.chart" . }}
app.kubernetes.io/name: {{ include "kubeon.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kubeon
{{- end -}}

{{/* Selector labels; call with (dict "root" $ "component" "worker"). */}}
{{- define "kubeon.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kubeon.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kubeon.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* R5.5, on pod and container alike. */}}
{{- define "kubeon.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "kubeon.containerSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
readOnlyRootFilesystem: true
allowPrivilegeEscalation: false
privileged: false
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "kubeon.temporalAddress" -}}
{{- if eq .Values.temporal.mode "external" -}}
{{- .Values.temporal.external.address -}}
{{- else -}}
{{- printf "%s.%s.svc:7233" (include "kubeon.temporalName" .) .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{- define "kubeon.gatewayURL" -}}
{{- printf "https://%s.%s.svc:%d" (include "kubeon.gatewayName" .) .Release.Namespace (int .Values.burst.gateway.service.port) -}}
{{- end -}}

{{- define "kubeon.ticketKeySecret" -}}
{{- .Values.burst.gateway.ticketKeySecret | default (printf "%s-ticket-key" (include "kubeon.gatewayName" .)) -}}
{{- end -}}

{{/* Directory of a location's existingSecret inside the worker: /var/run/kubeon/burst/<provider>.<region> */}}
{{- define "kubeon.locationDir" -}}
{{- printf "/var/run/kubeon/burst/%s" (replace "/" "." .) -}}
{{- end -}}

{{/*
Checks the schema cannot express; each failure names the value.
*/}}
{{- define "kubeon.validate" -}}
{{- $seen := dict -}}
{{- range $i, $loc := .Values.burst.locations -}}
{{- if hasKey $seen $loc.name -}}
{{- fail (printf "burst.locations[%d].name: %q is listed twice" $i $loc.name) -}}
{{- end -}}
{{- $_ := set $seen $loc.name true -}}
{{- end -}}
{{- end -}}
