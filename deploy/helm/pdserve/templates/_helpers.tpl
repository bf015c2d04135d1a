{{/* Names, labels, image, and the pieces every pdserve pod shares. */}}

{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* (dict "root" $ "component" "decode") -> release-pdserve-decode */}}
{{- define "pdserve.componentName" -}}
{{- printf "%s-%s" (include "pdserve.fullname" .root | trunc 52 | trimSuffix "-") .component }}
{{- end }}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: pdserve
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end }}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* (dict "root" $ "override" .Values.decode.image): a component's image, else the chart's */}}
{{- define "pdserve.image" -}}
{{- $img := .root.Values.image }}
{{- $repo := default $img.repository .override.repository }}
{{- $tag := default (default (printf "%s%s" .root.Chart.AppVersion $img.tagSuffix) $img.tag) .override.tag }}
{{- printf "%s:%s" $repo $tag }}
{{- end }}

{{- define "pdserve.redisUrl" -}}
{{- if .Values.redis.external.url }}
{{- .Values.redis.external.url }}
{{- else }}
{{- printf "redis://%s:%d/0" (include "pdserve.componentName" (dict "root" . "component" "redis")) (int .Values.redis.port) }}
{{- end }}
{{- end }}

{{- define "pdserve.inChartRedis" -}}
{{- if not (or .Values.redis.external.url .Values.redis.external.urlSecret.name) }}true{{ end }}
{{- end }}

{{/* The --model folder inside the pod; empty for the image's default model. */}}
{{- define "pdserve.modelDir" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "hub" }}/models/hub
{{- else if has $m.source (list "pvc" "hostPath") }}{{ trimSuffix "/" (printf "/models/%s" (trimPrefix "/" $m.path)) }}
{{- end }}
{{- end }}

{{- define "pdserve.modelVolume" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath:
    path: {{ $m.hostPath.path }}
    type: Directory
{{- else if eq $m.source "hub" }}
- name: model
  emptyDir:
    sizeLimit: {{ $m.hub.sizeLimit }}
{{- end }}
{{- end }}

{{/* The hub download runs before the service, in the same image (its `hf` command). */}}
{{- define "pdserve.modelInitContainers" -}}
{{- $m := .root.Values.model }}
{{- if eq $m.source "hub" }}
{{- $cmd := list "hf" "download" $m.hub.id "--local-dir" "/models/hub" }}
{{- with $m.hub.revision }}{{ $cmd = concat $cmd (list "--revision" .) }}{{ end }}
{{- with $m.hub.include }}{{ $cmd = concat $cmd (list "--include") . }}{{ end }}
- name: fetch-model
  image: {{ include "pdserve.image" (dict "root" .root "override" .values.image) }}
  imagePullPolicy: {{ default .root.Values.image.pullPolicy .values.image.pullPolicy }}
  command: {{- toYaml $cmd | nindent 4 }}
  env:
    - name: HF_HUB_OFFLINE
      value: "0"
    {{- with $m.hub.tokenSecret.name }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef: {name: {{ . }}, key: {{ $m.hub.tokenSecret.key }}}
    {{- end }}
  securityContext: {{- toYaml .root.Values.containerSecurityContext | nindent 4 }}
  volumeMounts:
    - {name: model, mountPath: /models}
    - {name: tmp, mountPath: /tmp}
    - {name: cache, mountPath: /cache}
{{- end }}
{{- end }}

{{/* Pull secrets and where a pod may run: (dict "root" $ "values" .Values.decode) */}}
{{- define "pdserve.podPlacement" -}}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity: {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Environment every pdserve service gets: the registry and the log level. */}}
{{- define "pdserve.commonEnv" -}}
- name: PDSERVE_REDIS
{{- if .Values.redis.external.urlSecret.name }}
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.external.urlSecret.name }}
      key: {{ .Values.redis.external.urlSecret.key }}
{{- else }}
  value: {{ include "pdserve.redisUrl" . | quote }}
{{- end }}
- name: PDSERVE_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
{{- end }}

{{/* Probe timings from values around a handler: (dict "handler" (dict "grpc" ...) "timing" $t) */}}
{{- define "pdserve.probe" -}}
{{- toYaml (merge (deepCopy .handler) .timing) }}
{{- end }}

{{- define "pdserve.pdb" -}}
{{- if .values.pdb.enabled }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "pdserve.componentName" . }}
  labels: {{- include "pdserve.labels" . | nindent 4 }}
spec:
  maxUnavailable: {{ .values.pdb.maxUnavailable }}
  selector:
    matchLabels: {{- include "pdserve.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end }}

{{/*
A service's command line from its settings, the chart's one rendering of them: each
setting by flag name (dashes or underscores) as --name=value, true as --name, false as
--no-name, a list as the flag repeated; in name order, as JSON (fromJsonArray). "settings"
are what the chart wires itself (ports, address, model); "extra", a component's
`settings` values, adds the rest and cannot change those.
*/}}
{{- define "pdserve.settingsArgs" -}}
{{- $all := dict }}
{{- range $k, $v := (.extra | default dict) }}{{ $_ := set $all (replace "_" "-" $k) $v }}{{ end }}
{{- range $k, $v := .settings }}{{ $_ := set $all $k $v }}{{ end }}
{{- $args := list }}
{{- range $k := keys $all | sortAlpha }}
{{- $v := get $all $k }}
{{- if kindIs "bool" $v }}
{{- $args = append $args (ternary (printf "--%s" $k) (printf "--no-%s" $k) $v) }}
{{- else if kindIs "slice" $v }}
{{- range $v }}{{ $args = append $args (printf "--%s=%v" $k .) }}{{ end }}
{{- else if and (kindIs "float64" $v) (eq $v (float64 (int64 $v))) }}
{{- $args = append $args (printf "--%s=%d" $k (int64 $v)) }}
{{- else }}
{{- $args = append $args (printf "--%s=%v" $k $v) }}
{{- end }}
{{- end }}
{{- toJson $args }}
{{- end }}
