{{/* The operator's rules for BatchJobs, shared by the Role (namespace scope) and ClusterRole (cluster scope). */}}
{{- define "prefixgrove.operator.batchJobRules" -}}
- apiGroups: [prefixgrove.io]
  resources: [batchjobs]
  verbs: [get, list, watch, patch]
- apiGroups: [prefixgrove.io]
  resources: [batchjobs/status]
  verbs: [get, patch]
# Owner references to a BatchJob with blockOwnerDeletion need update on its finalizers.
- apiGroups: [prefixgrove.io]
  resources: [batchjobs/finalizers]
  verbs: [update]
# spec.input.configMap is read by the operator and streamed to the planner.
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- with .Values.operator.credentialsSecrets }}
# spec.credentialsSecret: these Secrets alone are read, and handed to the planner and the writer of
# the results; no other Secret is readable.
- apiGroups: [""]
  resources: [secrets]
  resourceNames: {{ toJson . }}
  verbs: [get]
{{- end }}
{{- end }}
