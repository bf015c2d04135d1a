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

{{/* The in-chart Redis's URL carries $(REDIS_PASSWORD), which the kubelet expands. */}}
{{- define "pdserve.redisUrl" -}}
{{- if .Values.redis.external.url }}
{{- .Values.redis.external.url }}
{{- else }}
{{- printf "redis://:$(REDIS_PASSWORD)@%s:%d/0" (include "pdserve.componentName" (dict "root" . "component" "redis")) (int .Values.redis.port) }}
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

{{/* Environment every pdserve service gets: the registry (with its password) and the log level. */}}
{{- define "pdserve.commonEnv" -}}
{{- if include "pdserve.inChartRedis" . }}
# Before PDSERVE_REDIS, whose URL refers to it: the kubelet expands earlier variables only.
# Not PDSERVE_*: those are read as flags.
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.secretName" (dict "root" . "component" "redis" "values" .Values.redis.auth) }}
      key: {{ .Values.redis.auth.key }}
{{- end }}
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
- name: PDSERVE_LOG_FORMAT
  value: {{ .Values.logFormat | quote }}
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

{{/*
A Secret the chart generates unless the values name an existing one:
(dict "root" $ "component" "api-keys" "values" .Values.auth.apiKeys) -> its name
*/}}
{{- define "pdserve.secretName" -}}
{{- .values.existingSecret | default (include "pdserve.componentName" (dict "root" .root "component" .component)) }}
{{- end }}

{{/*
The Secret files a service reads, and the flags naming them: (dict "root" $ "component"
"router") -> JSON {"settings": {flag: path}, "volumes": [{name, secret, dir, items: [{key,
file}]}]}. Every service gets the cluster secret; the router its API keys, its own TLS
and the client side of internal TLS; the workers the server side of internal TLS.
*/}}
{{- define "pdserve.credentials" -}}
{{- $auth := .root.Values.auth }}
{{- $tls := .root.Values.tls }}
{{- $mutual := $tls.internal.mutual }}
{{- $volumes := list (dict "name" "cluster-secret" "dir" "/etc/pdserve/cluster"
      "secret" (include "pdserve.secretName" (dict "root" .root "component" "cluster-secret" "values" $auth.clusterSecret))
      "items" (list (dict "key" $auth.clusterSecret.key "file" "secret" "flag" "cluster-secret-file"))) }}
{{- if eq .component "router" }}
{{- if $auth.apiKeys.enabled }}
{{- $volumes = append $volumes (dict "name" "api-keys" "dir" "/etc/pdserve/api-keys"
      "secret" (include "pdserve.secretName" (dict "root" .root "component" "api-keys" "values" $auth.apiKeys))
      "items" (list (dict "key" $auth.apiKeys.key "file" "keys" "flag" "api-key-file"))) }}
{{- end }}
{{- with $tls.router.secretName }}
{{- $volumes = append $volumes (dict "name" "tls" "dir" "/etc/pdserve/tls" "secret" .
      "items" (list (dict "key" "tls.crt" "file" "tls.crt" "flag" "tls-cert") (dict "key" "tls.key" "file" "tls.key" "flag" "tls-key"))) }}
{{- end }}
{{- with $tls.internal.secretName }}
{{- $items := list (dict "key" "ca.crt" "file" "ca.crt" "flag" "worker-tls-ca") }}
{{- if $mutual }}
{{- $items = concat $items (list (dict "key" "tls.crt" "file" "tls.crt" "flag" "worker-tls-cert") (dict "key" "tls.key" "file" "tls.key" "flag" "worker-tls-key")) }}
{{- end }}
{{- $volumes = append $volumes (dict "name" "internal-tls" "dir" "/etc/pdserve/internal-tls" "secret" . "items" $items) }}
{{- end }}
{{- else if has .component (list "prefill" "decode") }}
{{- with $tls.internal.secretName }}
{{- $items := list (dict "key" "tls.crt" "file" "tls.crt" "flag" "tls-cert") (dict "key" "tls.key" "file" "tls.key" "flag" "tls-key") }}
{{- if $mutual }}{{ $items = append $items (dict "key" "ca.crt" "file" "ca.crt" "flag" "tls-ca") }}{{ end }}
{{- $volumes = append $volumes (dict "name" "internal-tls" "dir" "/etc/pdserve/internal-tls" "secret" . "items" $items) }}
{{- end }}
{{- end }}
{{- $settings := dict }}
{{- range $volumes }}
{{- $dir := .dir }}
{{- range .items }}{{ $_ := set $settings .flag (printf "%s/%s" $dir .file) }}{{ end }}
{{- end }}
{{- toJson (dict "settings" $settings "volumes" $volumes) }}
{{- end }}

{{/* The volumes of pdserve.credentials, mounted read-only: (dict "root" $ "volumes" $list) */}}
{{- define "pdserve.secretMounts" -}}
{{- range .volumes }}
- {name: {{ .name }}, mountPath: {{ .dir }}, readOnly: true}
{{- end }}
{{- end }}

{{/*
Secret files are owned by root and, with an fsGroup, by the pod's group: 0440 lets the
service read them through that group and no one else. Without an fsGroup the files stay
root's, so a non-root service needs the world-read bit.
*/}}
{{- define "pdserve.secretVolumes" -}}
{{- $mode := ternary "0440" "0444" (hasKey .root.Values.podSecurityContext "fsGroup") }}
{{- range .volumes }}
- name: {{ .name }}
  secret:
    secretName: {{ .secret }}
    defaultMode: {{ $mode }}
    items:
      {{- range .items }}
      - {key: {{ .key | quote }}, path: {{ .file }}}
      {{- end }}
{{- end }}
{{- end }}

{{/* A NetworkPolicyPeer: this release's pods of some components: (dict "root" $ "components" (list ...)) */}}
{{- define "pdserve.peers" -}}
podSelector:
  matchLabels:
    app.kubernetes.io/name: {{ include "pdserve.name" .root }}
    app.kubernetes.io/instance: {{ .root.Release.Name }}
  matchExpressions:
    - {key: app.kubernetes.io/component, operator: In, values: {{ toJson .components }}}
{{- end }}
