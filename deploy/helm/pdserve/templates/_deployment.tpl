{{/*
The Deployment of one pdserve service (router, prefill or decode). The caller passes
what differs between them:
  root       $
  component  "router" | "prefill" | "decode"
  values     that component's values (the keys they share: replicas, image, resources,
             scheduling, env, extraArgs, drainSeconds, probes, ...)
  args       the service's command line after `pdserve`
  ports      container ports [{name, containerPort}]
  probes     {startup, readiness, liveness}: a probe handler each; timings come from values
  metricsPort  the port Prometheus scrapes (path /metrics)
  metricsScheme  "https" when that port serves TLS, else "" (http)
  secrets    Secret files to mount read-only: pdserve.credentials' "volumes"
  env        environment before the user's (may be empty)
  shmSize    size of a memory-backed /dev/shm, or "" for none
  autoscaled true: the autoscaler owns spec.replicas: the live Deployment's count is
             rendered (a value of ours would reset the pool on every `helm upgrade`, a
             field left out resets it to 1 in the upgrade that turns autoscaling on)
The worker pools also pass what their KV network asks (pdserve.kvNetwork):
  resources        in place of values.resources
  securityContext  in place of the chart's containerSecurityContext
  annotations      pod annotations over values.podAnnotations
  hostNetwork      true: the pod runs in the node's network namespace
*/}}
{{- define "pdserve.deployment" -}}
{{- $root := .root }}
{{- $v := .values }}
{{- $modelVolume := include "pdserve.modelVolume" $root }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "pdserve.componentName" . }}
  labels: {{- include "pdserve.labels" . | nindent 4 }}
spec:
  {{- if not .autoscaled }}
  replicas: {{ $v.replicas }}
  {{- else }}
  {{- /* Owned by the autoscaler: the live count, so that turning autoscaling on in an
         upgrade leaves the pool as it is (a field dropped from the manifest is reset to 1). */}}
  {{- with lookup "apps/v1" "Deployment" $root.Release.Namespace (include "pdserve.componentName" .) }}
  replicas: {{ .spec.replicas }}
  {{- end }}
  {{- end }}
  {{- with $v.strategy }}
  strategy: {{- toYaml . | nindent 4 }}
  {{- end }}
  revisionHistoryLimit: 3
  selector:
    matchLabels: {{- include "pdserve.selectorLabels" . | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "pdserve.labels" . | nindent 8 }}
        {{- with $v.podLabels }}{{ toYaml . | nindent 8 }}{{ end }}
      {{- $annotations := deepCopy $v.podAnnotations }}
      {{- range $k, $val := .annotations }}{{ $_ := set $annotations $k $val }}{{ end }}
      {{- if $root.Values.metrics.podAnnotations }}
      {{- $_ := merge $annotations (dict "prometheus.io/scrape" "true" "prometheus.io/port" (toString .metricsPort) "prometheus.io/path" "/metrics") }}
      {{- with .metricsScheme }}{{ $_ := set $annotations "prometheus.io/scheme" . }}{{ end }}
      {{- end }}
      {{- with $annotations }}
      annotations: {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      serviceAccountName: {{ include "pdserve.serviceAccountName" $root }}
      automountServiceAccountToken: false
      # PDSERVE_* variables are read as flags, and service links would add some (a Service
      # named pdserve anywhere in the namespace brings PDSERVE_PORT=tcp://...).
      enableServiceLinks: false
      terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
      {{- with $v.runtimeClassName }}
      runtimeClassName: {{ . }}
      {{- end }}
      {{- with $v.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      {{- if .hostNetwork }}
      # The node's network namespace: its NICs and address. Its ports are the node's (each
      # container port is a hostPort), so pods sharing a port never share a node.
      hostNetwork: true
      dnsPolicy: ClusterFirstWithHostNet
      {{- end }}
      securityContext: {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      {{- with include "pdserve.podPlacement" (dict "root" $root "values" $v) }}{{ trim . | nindent 6 }}{{ end }}
      {{- with include "pdserve.modelInitContainers" . }}
      initContainers: {{- trim . | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ .component }}
          image: {{ include "pdserve.image" (dict "root" $root "override" $v.image) }}
          imagePullPolicy: {{ default $root.Values.image.pullPolicy $v.image.pullPolicy }}
          args: {{- toYaml (concat .args $v.extraArgs) | nindent 12 }}
          ports:
            {{- range .ports }}
            - {name: {{ .name }}, containerPort: {{ .containerPort }}{{ if $.hostNetwork }}, hostPort: {{ .containerPort }}{{ end }}, protocol: TCP}
            {{- end }}
          env:
            {{- include "pdserve.commonEnv" $root | nindent 12 }}
            {{- with .env }}{{ toYaml . | nindent 12 }}{{ end }}
            {{- with $v.env }}{{ toYaml . | nindent 12 }}{{ end }}
          startupProbe: {{- include "pdserve.probe" (dict "handler" .probes.startup "timing" $v.probes.startup) | nindent 12 }}
          readinessProbe: {{- include "pdserve.probe" (dict "handler" .probes.readiness "timing" $v.probes.readiness) | nindent 12 }}
          livenessProbe: {{- include "pdserve.probe" (dict "handler" .probes.liveness "timing" $v.probes.liveness) | nindent 12 }}
          {{- if $v.drainSeconds }}
          lifecycle:
            # Endpoints drop a terminating pod only after a moment; SIGTERM (the service's
            # own drain) waits for that. Workers need no wait (0): at SIGTERM they leave
            # the registry and refuse new work, which the router then sends elsewhere.
            preStop:
              exec:
                command: ["sleep", "{{ $v.drainSeconds }}"]
          {{- end }}
          {{- with .resources | default $v.resources }}
          resources: {{- toYaml . | nindent 12 }}
          {{- end }}
          securityContext: {{- toYaml (.securityContext | default $root.Values.containerSecurityContext) | nindent 12 }}
          volumeMounts:
            - {name: tmp, mountPath: /tmp}
            - {name: cache, mountPath: /cache}
            {{- if .shmSize }}
            - {name: dshm, mountPath: /dev/shm}
            {{- end }}
            {{- if $modelVolume }}
            - {name: model, mountPath: /models, readOnly: true}
            {{- end }}
            {{- with include "pdserve.secretMounts" (dict "volumes" .secrets) }}{{ trim . | nindent 12 }}{{ end }}
      volumes:
        - name: tmp
          emptyDir: {}
        - name: cache
          emptyDir: {}
        {{- if .shmSize }}
        - name: dshm
          emptyDir: {medium: Memory, sizeLimit: {{ .shmSize }}}
        {{- end }}
        {{- with $modelVolume }}{{ trim . | nindent 8 }}{{ end }}
        {{- with include "pdserve.secretVolumes" (dict "root" $root "volumes" .secrets) }}{{ trim . | nindent 8 }}{{ end }}
{{- end }}
