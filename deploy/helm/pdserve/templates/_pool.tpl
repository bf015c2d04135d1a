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
{{- /* Running requests get what the grace period leaves after preStop and the worker's own
       stop past its drain (WorkerSettings.stop_seconds: 5 s of gRPC grace, 10 s of joins a
       rank, 15 s of slack): then each ends with an error, and the pod is not killed first. */}}
{{- $tp := int ($pool.tensorParallelSize | default 1) }}
{{- $drain := max 1 (sub (sub (int $pool.terminationGracePeriodSeconds) (int $pool.drainSeconds)) (add 20 (mul 10 $tp))) }}
{{- $settings := dict "host" "0.0.0.0" "port" $grpcPort "metrics-port" (int $pool.metricsPort) "drain-timeout" $drain
      "advertise" (printf "$(POD_IP):%d" $grpcPort) "kv-transport" $pool.kvTransport "dtype" $pool.dtype
      "device" $pool.device "threads" (int $pool.threads)
      "tensor-parallel-size" $tp }}
{{- with include "pdserve.modelDir" $root }}{{ $_ := set $settings "model" . }}{{ end }}
{{- with $root.Values.model.servedModelName }}{{ $_ := set $settings "served-model-name" . }}{{ end }}
{{- /* One quantization for both pools: the router pairs only workers whose KV agree. */}}
{{- if ne ($root.Values.model.quantization | default "none") "none" }}{{ $_ := set $settings "quantization" $root.Values.model.quantization }}{{ end }}
{{- $credentials := include "pdserve.credentials" $ctx | fromJson }}
{{- $settings = merge $settings $credentials.settings }}
{{- $args := prepend (include "pdserve.settingsArgs" (dict "settings" $settings "extra" $pool.settings) | fromJsonArray) $role }}
{{- $health := dict "grpc" (dict "port" $grpcPort) }}
{{- if $root.Values.tls.internal.secretName }}
{{- /* The kubelet's gRPC probes cannot speak TLS; the port opens once the model is loaded. */}}
{{- $health = dict "tcpSocket" (dict "port" "grpc") }}
{{- end }}
{{- /* With hostNetwork, status.podIP is the node's address: the advertised one stays right. */}}
{{- $env := list (dict "name" "POD_IP" "valueFrom" (dict "fieldRef" (dict "fieldPath" "status.podIP"))) }}
{{- /* The kernel compilers' caches default to $HOME, on the read-only root: the /cache
emptyDir instead, as in the image (an image built elsewhere may not set them). */}}
{{- range $name, $dir := dict "CUDA_CACHE_PATH" "nv" "TRITON_CACHE_DIR" "triton"
      "TORCHINDUCTOR_CACHE_DIR" "torchinductor" "TVM_FFI_CACHE_DIR" "tvm-ffi" }}
{{- $env = append $env (dict "name" $name "value" (printf "/cache/%s" $dir)) }}
{{- end }}
{{- $env = concat $env (include "pdserve.ucxEnv" $pool.ucx | fromJsonArray) }}
{{- $network := include "pdserve.kvNetwork" (dict "root" $root "pool" $pool) | fromYaml }}
{{- include "pdserve.deployment" (merge (dict
      "args" $args
      "ports" (list (dict "name" "grpc" "containerPort" $grpcPort) (dict "name" "metrics" "containerPort" (int $pool.metricsPort)))
      "probes" (dict "startup" $health "readiness" $health "liveness" $health)
      "metricsPort" $pool.metricsPort
      "env" $env
      "secrets" $credentials.volumes
      "shmSize" $pool.shmSize
      "autoscaled" (or $root.Values.autoscaler.enabled (include "pdserve.podAutoscaled" (dict "root" $root "role" $role))))
      $network $ctx) }}
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

{{/*
What the KV transfer's network asks of a pool's pods (docs/deploy.md, "Networks for the
KV transfer"), as the pdserve.deployment arguments it sets: (dict "root" $ "pool" $pool)
  resources        the pool's, plus rdma.count of rdma.resource in requests and limits
                   (an extended resource: the two must be equal); nvidia.com/gpu raised
                   to tensorParallelSize where it is asked for
  securityContext  the chart's containerSecurityContext with the pool's securityContext
                   over it: capabilities.add joins the chart's drop [ALL], never replaces it
  annotations      network.secondary as Multus's k8s.v1.cni.cncf.io/networks
  hostNetwork      network.hostNetwork
*/}}
{{- define "pdserve.kvNetwork" -}}
{{- $pool := .pool }}
{{- $resources := deepCopy ($pool.resources | default dict) }}
{{- /* A GPU pod: one GPU per tensor-parallel rank at least. */}}
{{- $tp := int ($pool.tensorParallelSize | default 1) }}
{{- range $kind := list "requests" "limits" }}
{{- $r := get $resources $kind | default dict }}
{{- if and (hasKey $r "nvidia.com/gpu") (lt (int (get $r "nvidia.com/gpu")) $tp) }}
{{- $_ := set $r "nvidia.com/gpu" $tp }}
{{- end }}
{{- end }}
{{- if $pool.rdma.enabled }}
{{- range $kind := list "requests" "limits" }}
{{- $r := get $resources $kind | default dict }}
{{- $_ := set $r $pool.rdma.resource (int $pool.rdma.count) }}
{{- $_ := set $resources $kind $r }}
{{- end }}
{{- end }}
{{- $securityContext := deepCopy .root.Values.containerSecurityContext }}
{{- $own := $pool.securityContext | default dict }}
{{- with ($own.capabilities | default dict).add }}
{{- $caps := $securityContext.capabilities | default dict }}
{{- $_ := set $caps "add" (concat ($caps.add | default list) . | uniq) }}
{{- $_ := set $securityContext "capabilities" $caps }}
{{- end }}
{{- range $key := list "runAsUser" "runAsNonRoot" }}
{{- if hasKey $own $key }}{{ $_ := set $securityContext $key (get $own $key) }}{{ end }}
{{- end }}
{{- $annotations := dict }}
{{- with $pool.network.secondary }}{{ $_ := set $annotations "k8s.v1.cni.cncf.io/networks" . }}{{ end }}
{{- toYaml (dict "resources" $resources "securityContext" $securityContext "annotations" $annotations
      "hostNetwork" $pool.network.hostNetwork) }}
{{- end }}

{{/*
UCX's environment from a pool's `ucx` values, as a JSON list of env entries: tls,
netDevices and gidIndex as UCX_TLS, UCX_NET_DEVICES and UCX_IB_GID_INDEX ("" leaves UCX
its default), then `env` (UCX_* and NIXL_* only, the schema says) in name order.
*/}}
{{- define "pdserve.ucxEnv" -}}
{{- $ucx := . | default dict }}
{{- $env := list }}
{{- range $name, $key := dict "UCX_TLS" "tls" "UCX_NET_DEVICES" "netDevices" "UCX_IB_GID_INDEX" "gidIndex" }}
{{- $value := toString (get $ucx $key) }}
{{- if $value }}{{ $env = append $env (dict "name" $name "value" $value) }}{{ end }}
{{- end }}
{{- range $name, $value := $ucx.env }}
{{- $env = append $env (dict "name" $name "value" (toString $value)) }}
{{- end }}
{{- toJson $env }}
{{- end }}

{{/*
"true" when podAutoscaling scales this pool (a KEDA ScaledObject or an HPA owns its
replicas), else "": (dict "root" $ "role" "decode")
*/}}
{{- define "pdserve.podAutoscaled" -}}
{{- $scaling := .root.Values.podAutoscaling }}
{{- if and (ne $scaling.kind "none") (index $scaling .role).enabled }}true{{ end }}
{{- end }}
