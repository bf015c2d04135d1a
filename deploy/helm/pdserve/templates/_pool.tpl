{{/*
A worker pool: its Deployment, headless Service and PodDisruptionBudget. prefill and
decode are both rendered here from values of the same shape, so the two pools differ
only in what their values say:
  {{ include "pdserve.pool" (dict "root" $ "role" "decode") }}
*/}}
{{- define "pdserve.pool" -}}
{{- $root := .root }}
{{- $role := .role }}
{{- $pool := index $root.Values $role }}
{{- $ctx := dict "root" $root "component" $role "values" $pool }}
{{- $grpcPort := int $pool.grpcPort }}
{{- $settings := dict "host" "0.0.0.0" "port" $grpcPort "metrics-port" (int $pool.metricsPort)
      "advertise" (printf "$(POD_IP):%d" $grpcPort) "kv-transport" $pool.kvTransport "dtype" $pool.dtype
      "device" $pool.device "threads" (int $pool.threads) }}
{{- with include "pdserve.modelDir" $root }}{{ $_ := set $settings "model" . }}{{ end }}
{{- $credentials := include "pdserve.credentials" $ctx | fromJson }}
{{- $settings = merge $settings $credentials.settings }}
{{- $args := prepend (include "pdserve.settingsArgs" (dict "settings" $settings "extra" $pool.settings) | fromJsonArray) $role }}
{{- $health := dict "grpc" (dict "port" $grpcPort) }}
{{- if $root.Values.tls.internal.secretName }}
{{- /* The kubelet's gRPC probes cannot speak TLS; the port opens once the model is loaded. */}}
{{- $health = dict "tcpSocket" (dict "port" "grpc") }}
{{- end }}
{{- $env := list (dict "name" "POD_IP" "valueFrom" (dict "fieldRef" (dict "fieldPath" "status.podIP"))) }}
{{- include "pdserve.deployment" (merge (dict
      "args" $args
      "ports" (list (dict "name" "grpc" "containerPort" $grpcPort) (dict "name" "metrics" "containerPort" (int $pool.metricsPort)))
      "probes" (dict "startup" $health "readiness" $health "liveness" $health)
      "metricsPort" $pool.metricsPort
      "env" $env
      "secrets" $credentials.volumes
      "shmSize" $pool.shmSize
      "autoscaled" $root.Values.autoscaler.enabled) $ctx) }}
---
# Headless: the router reaches each worker by the address it registered, never through a
# load-balanced virtual IP; the Service gives the pods DNS names and a metrics target.
apiVersion: v1
kind: Service
metadata:
  name: {{ include "pdserve.componentName" $ctx }}
  labels: {{- include "pdserve.labels" $ctx | nindent 4 }}
spec:
  clusterIP: None
  selector: {{- include "pdserve.selectorLabels" $ctx | nindent 4 }}
  ports:
    - {name: grpc, port: {{ $grpcPort }}, targetPort: grpc, protocol: TCP, appProtocol: grpc}
    - {name: metrics, port: {{ $pool.metricsPort }}, targetPort: metrics, protocol: TCP}
{{- with include "pdserve.pdb" $ctx }}
---
{{ . }}
{{- end }}
{{- end }}
