{{- define "nodeguard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "nodeguard.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "nodeguard.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "nodeguard.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "nodeguard.serviceAccountName" -}}
{{- default (include "nodeguard.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "nodeguard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "nodeguard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "nodeguard.labels" -}}
{{ include "nodeguard.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The image reference: repository:tag, pinned by digest when image.digest is set. */}}
{{- define "nodeguard.image" -}}
{{- $ref := printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- if .Values.image.digest -}}{{- $ref = printf "%s@%s" $ref .Values.image.digest -}}{{- end -}}
{{- $ref -}}
{{- end -}}
