{{/* The name label: the chart's name unless nameOverride. */}}
{{- define "kvengine.name" -}}
{{- default .Chart.Name .Values.nameOverride }}
{{- end }}

{{/* The objects' name: the release name unless fullnameOverride. */}}
{{- define "kvengine.fullname" -}}
{{- default .Release.Name .Values.fullnameOverride }}
{{- end }}

{{/* What the Deployment, Service and ServiceMonitor select pods by. */}}
{{- define "kvengine.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvengine.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Every object's labels. */}}
{{- define "kvengine.labels" -}}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{ include "kvengine.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The Secret holding the admin token: the one named in adminToken.existingSecret, else
the one the chart generates. */}}
{{- define "kvengine.adminSecret" -}}
{{- if .Values.adminToken.existingSecret -}}
{{ .Values.adminToken.existingSecret }}
{{- else -}}
{{ include "kvengine.fullname" . }}-admin
{{- end -}}
{{- end }}
