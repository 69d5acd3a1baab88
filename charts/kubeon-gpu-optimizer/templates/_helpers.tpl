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

{{/*
The gateway's TLS (R4.3): its serving certificate and the CA the worker and burst nodes verify it with.
*/}}
{{- define "kubeon.gatewayTLSSecret" -}}
{{- .Values.burst.gateway.tls.existingSecret | default (printf "%s-tls" (include "kubeon.gatewayName" .)) -}}
{{- end -}}

{{- define "kubeon.gatewayCAConfigMap" -}}
{{- printf "%s-ca" (include "kubeon.gatewayName" .) -}}
{{- end -}}

{{/* The host of burst.gateway.publicUrl, lower case, without port or IPv6 brackets ("" when unset). */}}
{{- define "kubeon.gatewayPublicHost" -}}
{{- with .Values.burst.gateway.publicUrl -}}{{- (urlParse .).hostname | lower -}}{{- end -}}
{{- end -}}

{{- define "kubeon.isIP" -}}
{{- if or (regexMatch "^[0-9]{1,3}(\\.[0-9]{1,3}){3}$" .) (contains ":" .) -}}true{{- end -}}
{{- end -}}

{{/* The generated certificate's names, as JSON lists: the Service's names in the cluster and publicUrl's host
(an IP SAN when it is an address). */}}
{{- define "kubeon.gatewayCertDNSNames" -}}
{{- $name := include "kubeon.gatewayName" . -}}
{{- $ns := .Release.Namespace -}}
{{- $names := list $name (printf "%s.%s" $name $ns) (printf "%s.%s.svc" $name $ns) (printf "%s.%s.svc.cluster.local" $name $ns) -}}
{{- $host := include "kubeon.gatewayPublicHost" . -}}
{{- if and $host (not (include "kubeon.isIP" $host)) -}}{{- $names = append $names $host -}}{{- end -}}
{{- $names | uniq | toJson -}}
{{- end -}}

{{- define "kubeon.gatewayCertIPs" -}}
{{- $host := include "kubeon.gatewayPublicHost" . -}}
{{- if and $host (include "kubeon.isIP" $host) -}}{{- list $host | toJson -}}{{- else -}}[]{{- end -}}
{{- end -}}

{{/*
The CA bundle (PEM) for burst.gateway.tls.existingSecret: tls.caBundle, else the Secret's own ca.crt (read at
install/upgrade time), else empty: the certificate then chains to a public CA and the system trust store is used.
*/}}
{{- define "kubeon.gatewayExistingCABundle" -}}
{{- if .Values.burst.gateway.tls.caBundle -}}
{{- .Values.burst.gateway.tls.caBundle -}}
{{- else -}}
{{- $secret := lookup "v1" "Secret" .Release.Namespace .Values.burst.gateway.tls.existingSecret -}}
{{- with (dig "data" "ca.crt" "" $secret) -}}{{- b64dec . -}}{{- end -}}
{{- end -}}
{{- end -}}

{{/* "true" when the worker gets a CA file for the gateway (the ConfigMap kubeon.gatewayCAConfigMap exists). */}}
{{- define "kubeon.gatewayHasCA" -}}
{{- if or (not .Values.burst.gateway.tls.existingSecret) (include "kubeon.gatewayExistingCABundle" .) -}}true{{- end -}}
{{- end -}}

{{/* Changes whenever the gateway's certificate may: rolls the gateway and the worker so both load it. */}}
{{- define "kubeon.gatewayTLSChecksum" -}}
{{- list .Values.burst.gateway.publicUrl .Values.burst.gateway.tls .Release.Namespace | toJson | sha256sum -}}
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
{{- $gw := .Values.burst.gateway -}}
{{- if and .Values.burst.enabled (not $gw.publicUrl) (ne $gw.service.type "LoadBalancer") -}}
{{- fail (printf "burst.gateway.publicUrl is required with burst.gateway.service.type=%s: only a LoadBalancer Service has an address the gateway can find itself; set the https URL burst nodes reach it at from their own cloud, e.g. https://<node address>:<nodePort> for NodePort" $gw.service.type) -}}
{{- end -}}
{{- end -}}

{{/* "true" when burst.locations has an on-prem pool (onprem/<pool>): the gateway then checks the hub's claims. */}}
{{- define "kubeon.onpremLocations" -}}
{{- range .Values.burst.locations }}{{ if hasPrefix "onprem/" .name }}true{{ end }}{{ end -}}
{{- end -}}

{{/* The audience of the token the worker sends to the gateway, which accepts no other. */}}
{{- define "kubeon.gatewayAudience" -}}kubeon-gateway{{- end -}}
