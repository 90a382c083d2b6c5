{{/* Names, labels and shared snippets. Every resource name is built here. */}}

{{- define "prefixgrove.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "prefixgrove.fullname" -}}
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

{{/* "<fullname>-<component>", kept within 63 characters. Call with (list $ "planner"). */}}
{{- define "prefixgrove.componentName" -}}
{{- $root := index . 0 -}}
{{- printf "%s-%s" (include "prefixgrove.fullname" $root | trunc 50 | trimSuffix "-") (index . 1) }}
{{- end }}

{{- define "prefixgrove.planner.fullname" -}}{{ include "prefixgrove.componentName" (list . "planner") }}{{- end }}
{{- define "prefixgrove.worker.fullname" -}}{{ include "prefixgrove.componentName" (list . "worker") }}{{- end }}
{{- define "prefixgrove.workerMetrics.fullname" -}}{{ include "prefixgrove.componentName" (list . "worker-metrics") }}{{- end }}
{{- define "prefixgrove.operator.fullname" -}}{{ include "prefixgrove.componentName" (list . "operator") }}{{- end }}
{{- define "prefixgrove.redis.fullname" -}}{{ include "prefixgrove.componentName" (list . "redis") }}{{- end }}
{{- define "prefixgrove.auth.fullname" -}}{{ include "prefixgrove.componentName" (list . "auth") }}{{- end }}
{{- define "prefixgrove.data.fullname" -}}{{ include "prefixgrove.componentName" (list . "data") }}{{- end }}
{{- define "prefixgrove.dashboard.fullname" -}}{{ include "prefixgrove.componentName" (list . "dashboard") }}{{- end }}

{{- define "prefixgrove.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every resource. Call with (list $ "component"). */}}
{{- define "prefixgrove.labels" -}}
{{- $root := index . 0 -}}
helm.sh/chart: {{ include "prefixgrove.chart" $root }}
{{ include "prefixgrove.selectorLabels" . }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
app.kubernetes.io/part-of: prefixgrove
{{- with $root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels: stable for the life of a release. Call with (list $ "component"). */}}
{{- define "prefixgrove.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "prefixgrove.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* Full image reference. Call with (list $ .Values.planner.image). */}}
{{- define "prefixgrove.image" -}}
{{- $root := index . 0 -}}
{{- $tag := default $root.Chart.AppVersion $root.Values.image.tag }}
{{- printf "%s/%s:%s" (trimSuffix "/" $root.Values.image.registry) (index . 1).name $tag }}
{{- end }}

{{- define "prefixgrove.operator.serviceAccountName" -}}
{{- include "prefixgrove.operator.fullname" . }}
{{- end }}

{{- define "prefixgrove.planner.address" -}}
{{- printf "%s.%s.svc:%d" (include "prefixgrove.planner.fullname" .) .Release.Namespace (int .Values.planner.port) }}
{{- end }}

{{/* Random secret value that survives upgrades: reuse the one already in the cluster. */}}
{{- define "prefixgrove.stickyRandom" -}}
{{- $root := index . 0 -}}
{{- $existing := lookup "v1" "Secret" $root.Release.Namespace (index . 1) }}
{{- if and $existing (hasKey $existing.data (index . 2)) }}
{{- index $existing.data (index . 2) | b64dec }}
{{- else }}
{{- randAlphaNum 32 }}
{{- end }}
{{- end }}

{{/* Env entries giving PREFIXGROVE_REDIS_URL, with the password taken from a Secret. */}}
{{- define "prefixgrove.redisEnv" -}}
{{- if .Values.redis.enabled -}}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ default (include "prefixgrove.redis.fullname" .) .Values.redis.auth.existingSecret }}
      key: {{ .Values.redis.auth.existingSecretKey }}
# NOTE: $(REDIS_PASSWORD) is expanded by the kubelet, so the password never appears in the pod spec.
- name: PREFIXGROVE_REDIS_URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s:%d/0" (include "prefixgrove.redis.fullname" .) (int .Values.redis.port) | quote }}
{{- else if .Values.redis.external.existingSecret -}}
- name: PREFIXGROVE_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.external.existingSecret }}
      key: {{ .Values.redis.external.existingSecretKey }}
{{- else -}}
- name: PREFIXGROVE_REDIS_URL
  value: {{ required "redis.external.url (or redis.external.existingSecret) is required when redis.enabled is false" .Values.redis.external.url | quote }}
{{- end }}
{{- end }}

{{/* Env entry carrying the planner's bearer token when auth is on. Call with (list $ "ENV_NAME"). */}}
{{- define "prefixgrove.authEnv" -}}
{{- $root := index . 0 -}}
{{- if $root.Values.auth.enabled -}}
- name: {{ index . 1 }}
  valueFrom:
    secretKeyRef:
      name: {{ default (include "prefixgrove.auth.fullname" $root) $root.Values.auth.existingSecret }}
      key: {{ $root.Values.auth.existingSecretKey }}
{{- end }}
{{- end }}

{{/* Cluster-scoped names must not collide between releases of the same name in two namespaces. */}}
{{- define "prefixgrove.operator.clusterRoleName" -}}
{{- printf "%s-%s" .Release.Namespace (include "prefixgrove.operator.fullname" .) }}
{{- end }}

{{/* The shared data volume (a claim, or an emptyDir to try things out). */}}
{{- define "prefixgrove.dataVolume" -}}
- name: data
{{- if .Values.data.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.data.existingClaim }}
{{- else if .Values.data.persistence.enabled }}
  persistentVolumeClaim:
    claimName: {{ include "prefixgrove.data.fullname" . }}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end }}

{{/* PodDisruptionBudget API: policy/v1 from Kubernetes 1.21, policy/v1beta1 before. */}}
{{- define "prefixgrove.pdb.apiVersion" -}}
{{- if .Capabilities.APIVersions.Has "policy/v1" }}policy/v1{{ else }}policy/v1beta1{{ end }}
{{- end }}

{{/* A writable /tmp for a read-only root file system (torch, triton and tokenizer caches). */}}
{{- define "prefixgrove.tmpVolume" -}}
- name: tmp
  emptyDir: {}
{{- end }}

{{/* ServiceMonitors need the Prometheus Operator's API; say so instead of failing at apply time. */}}
{{- define "prefixgrove.serviceMonitor.enabled" -}}
{{- if .Values.metrics.serviceMonitor.enabled }}
{{- if not (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1") }}
{{- fail "metrics.serviceMonitor.enabled needs the monitoring.coreos.com/v1 API (Prometheus Operator CRDs); install them or pass --api-versions monitoring.coreos.com/v1" }}
{{- end }}
{{- true }}
{{- end }}
{{- end }}

{{/*
TLS on the planner's API: the values must name the Secrets they need.
*/}}
{{- define "prefixgrove.tls.check" -}}
{{- if .Values.tls.enabled }}
{{- if not .Values.tls.secretName }}
{{- fail "tls.enabled needs tls.secretName: a Secret with the planner's tls.crt, tls.key and ca.crt" }}
{{- end }}
{{- if and .Values.tls.mutual (not .Values.tls.clientSecretName) }}
{{- fail "tls.mutual needs tls.clientSecretName: a Secret with the tls.crt and tls.key the operator presents" }}
{{- end }}
{{- else if .Values.tls.mutual }}
{{- fail "tls.mutual needs tls.enabled" }}
{{- end }}
{{- end }}

{{/*
The worker pools, as JSON {"pools": [...]}: one per entry of models, or, with models empty, the one
pool of worker.* serving worker.model (name "": no --served-model-name, no pool label). Each pool
has its served name, source, Deployment name, pool label (the name as a DNS label) and every
per-pool setting, from the entry or else from worker.* and autoscaling.*; a pool with device cpu
as "prefixgrove.onDevice" says.
Read it with (fromJson (include "prefixgrove.workerPools" .)).pools.
*/}}
{{- define "prefixgrove.workerPools" -}}
{{- $w := .Values.worker }}
{{- $a := .Values.autoscaling }}
{{- $defaults := dict "replicas" $w.replicas "minReplicas" $a.minReplicas "maxReplicas" $a.maxReplicas
      "groupsPerWorker" $a.groupsPerWorker "gpus" $w.gpus "device" $w.device "extraArgs" $w.extraArgs
      "quantization" $w.quantization "kvCacheDtype" $w.kvCacheDtype
      "resources" $w.resources "nodeSelector" $w.nodeSelector "tolerations" $w.tolerations }}
{{- $worker := include "prefixgrove.worker.fullname" . }}
{{- $pools := list }}
{{- if not .Values.models }}
{{- $single := merge (dict "name" "" "source" $w.model "pool" "" "deployment" $worker "where" "worker") $defaults }}
{{- $pools = append $pools (fromJson (include "prefixgrove.onDevice" (dict "pool" $single "own" dict "cpu" $w.cpu))) }}
{{- else }}
{{- $seen := dict }}
{{- range $i, $m := .Values.models }}
{{- $where := printf "models[%d]" $i }}
{{- $name := toString (default "" $m.name) }}
{{- if or (not $name) (regexMatch "[[:space:],=]" $name) }}
{{- fail (printf "%s.name %q is invalid: a served model name, without spaces, ',' or '='" $where $name) }}
{{- end }}
{{- $pool := regexReplaceAll "[^a-z0-9-]+" (lower $name) "-" | trimAll "-" }}
{{- $deployment := printf "%s-%s" $worker $pool }}
{{- if not $pool }}
{{- fail (printf "%s.name %q can't form a DNS label for its worker Deployment: it needs a letter or digit" $where $name) }}
{{- end }}
{{- if gt (len $deployment) 63 }}
{{- fail (printf "%s.name %q makes the worker Deployment name %s longer than 63 characters: shorten the name (or fullnameOverride)" $where $name $deployment) }}
{{- end }}
{{- if hasKey $seen $pool }}
{{- if eq (index $seen $pool) $name }}
{{- fail (printf "%s.name %q is a duplicate: every model is served by one pool" $where $name) }}
{{- end }}
{{- fail (printf "%s.name %q and %q both become the worker Deployment %s: rename one" $where (index $seen $pool) $name $deployment) }}
{{- end }}
{{- $_ := set $seen $pool $name }}
{{- if not $m.source }}
{{- fail (printf "%s.source is required: a preset, or a path under worker.modelVolume.mountPath" $where) }}
{{- end }}
{{- $entry := dict "name" $name "source" (toString $m.source) "pool" $pool "deployment" $deployment "where" $where }}
{{- range $key, $default := $defaults }}
{{- $_ := set $entry $key (ternary (index $m $key) $default (hasKey $m $key)) }}
{{- end }}
{{- if lt (int $entry.maxReplicas) (int $entry.minReplicas) }}
{{- fail (printf "%s.maxReplicas (%v) must be >= %s.minReplicas (%v) (each falls back to autoscaling.*)" $where $entry.maxReplicas $where $entry.minReplicas) }}
{{- end }}
{{- $pools = append $pools (fromJson (include "prefixgrove.onDevice" (dict "pool" $entry "own" $m "cpu" $w.cpu))) }}
{{- end }}
{{- end }}
{{- toJson (dict "pools" $pools) }}
{{- end }}

{{/*
A worker pool (dict "pool" POOL "own" ENTRY "cpu" worker.cpu) fitted to its device, as JSON. A CPU
pool reserves no GPU, and takes worker.cpu's resources, nodeSelector and tolerations for those its
own entry (a models entry; none for worker.*) leaves out, never the GPU nodes' ones of worker.*, so a
CPU trial schedules on any node. An entry asking for device cpu and GPUs is refused.
*/}}
{{- define "prefixgrove.onDevice" -}}
{{- $p := .pool }}
{{- if eq $p.device "cpu" }}
{{- if gt (int (default 0 .own.gpus)) 0 }}
{{- fail (printf "%s.device is cpu but %s.gpus is %d: set %s.gpus=0 so no GPU is reserved for nothing" $p.where $p.where (int .own.gpus) $p.where) }}
{{- end }}
{{- $_ := set $p "gpus" 0 }}
{{- range $key := list "resources" "nodeSelector" "tolerations" }}
{{- if not (hasKey $.own $key) }}
{{- $_ := set $p $key (index $.cpu $key) }}
{{- end }}
{{- end }}
{{- end }}
{{- toJson $p }}
{{- end }}
