{{/*
Environment of every Ray container. The launcher (head pod) reads the run file's missing pieces from it:
the Redis URL (built from the password Secret with Kubernetes' $(VAR) expansion, or an external URL's
Secret) and the API token; Ray's workers inherit it, so the hub token reaches every model download.
*/}}
{{- define "vcpo-rl.rayEnv" -}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- if include "vcpo-rl.redisExternal" . }}
- name: VCPO_RUN__REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "vcpo-rl.redisUrlSecret" . }}
      key: {{ include "vcpo-rl.redisUrlKey" . }}
{{- else }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "vcpo-rl.redisPasswordSecret" . }}
      key: {{ include "vcpo-rl.redisPasswordKey" . }}
- name: VCPO_RUN__REDIS_URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s-redis.%s.svc:6379/0" (include "vcpo-rl.fullname" .) .Release.Namespace | quote }}
{{- end }}
- name: VCPO_SAMPLER__API_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "vcpo-rl.apiTokenSecret" . }}
      key: {{ include "vcpo-rl.apiTokenKey" . }}
{{- with .Values.tls }}
{{- if and .clientCaSecret (not .apiSecret) }}
{{- fail "tls.clientCaSecret (mutual TLS) needs tls.apiSecret, the client API's own certificate" }}
{{- end }}
{{- if .apiSecret }}
- name: VCPO_SAMPLER__API_TLS__CERT_FILE
  value: /etc/vcpo/tls/api/tls.crt
- name: VCPO_SAMPLER__API_TLS__KEY_FILE
  value: /etc/vcpo/tls/api/tls.key
{{- end }}
{{- if .clientCaSecret }}
- name: VCPO_SAMPLER__API_TLS__CLIENT_CA_FILE
  value: /etc/vcpo/tls/client-ca/ca.crt
{{- end }}
{{- if .envCaSecret }}
- name: VCPO_SAMPLER__ENV_TLS__CA_FILE
  value: /etc/vcpo/tls/env-ca/ca.crt
{{- end }}
{{- if .envClientSecret }}
- name: VCPO_SAMPLER__ENV_TLS__CERT_FILE
  value: /etc/vcpo/tls/env-client/tls.crt
- name: VCPO_SAMPLER__ENV_TLS__KEY_FILE
  value: /etc/vcpo/tls/env-client/tls.key
{{- end }}
{{- end }}
{{- if include "vcpo-rl.hubEnabled" . }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "vcpo-rl.hubSecret" . }}
      key: {{ include "vcpo-rl.hubKey" . }}
{{- end }}
{{- if .Values.hub.sharedCache }}
- name: HF_HOME
  value: {{ printf "%s/hf-cache" (trimSuffix "/" .Values.sharedStorage.mountPath) | quote }}
{{- end }}
{{- range $name, $value := .Values.weightBroker.group.ncclEnv }}
- name: {{ $name }}
  value: {{ $value | quote }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "vcpo-rl.rayVolumeMounts" -}}
- name: run-config
  mountPath: /etc/vcpo
  readOnly: true
- name: data
  mountPath: {{ .Values.sharedStorage.mountPath }}
- name: dshm
  mountPath: /dev/shm
{{- range $mount := include "vcpo-rl.tlsMounts" . | fromYamlArray }}
- name: {{ $mount.volume }}
  mountPath: {{ printf "/etc/vcpo/tls/%s" $mount.dir }}
  readOnly: true
{{- end }}
{{- with .Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "vcpo-rl.rayVolumes" -}}
- name: run-config
  configMap:
    name: {{ include "vcpo-rl.fullname" . }}-run-config
- name: data
  persistentVolumeClaim:
    claimName: {{ include "vcpo-rl.dataClaim" . }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.rayCluster.shmSize }}
{{- range $mount := include "vcpo-rl.tlsMounts" . | fromYamlArray }}
- name: {{ $mount.volume }}
  secret:
    secretName: {{ $mount.secret }}
    defaultMode: 0440
{{- end }}
{{- with .Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
Container resources with the group's GPUs added as nvidia.com/gpu (requests = limits, as extended
resources require). Arguments: dict "resources" <values> "gpus" <int>
*/}}
{{- define "vcpo-rl.resourcesWithGpus" -}}
{{- $res := deepCopy (default dict .resources) -}}
{{- if gt (int .gpus) 0 -}}
{{- $limits := deepCopy (default dict $res.limits) -}}
{{- $requests := deepCopy (default dict $res.requests) -}}
{{- $_ := set $limits "nvidia.com/gpu" (int .gpus) -}}
{{- $_ := set $requests "nvidia.com/gpu" (int .gpus) -}}
{{- $_ := set $res "limits" $limits -}}
{{- $_ := set $res "requests" $requests -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{/*
A pod's tolerations: the global `tolerations`, then the pod's own (dict "ctx" . "own" <list>), each once, as
a YAML list.
*/}}
{{- define "vcpo-rl.tolerations" -}}
{{- concat (default list .ctx.Values.tolerations) (default list .own) | uniq | toYaml -}}
{{- end -}}

{{/*
The learner pods' affinity: learner.affinity, and where the learner has several pods, the chart's rule for
where they go: on one node (a required podAffinity among the pods of one RayCluster: KubeRay's ray.io/cluster
label tells them from a replaced job's pods, which may still be terminating), or spread over nodes with
learner.spreadAcrossNodes. One node keeps ZeRO-3's per-micro-batch gathers off the link between nodes. A
podAffinity or podAntiAffinity in learner.affinity replaces the chart's.
*/}}
{{- define "vcpo-rl.learnerAffinity" -}}
{{- $v := .Values -}}
{{- $affinity := deepCopy (default dict $v.learner.affinity) -}}
{{- if and (gt (int $v.learner.ranks) (int $v.learner.ranksPerPod)) (not (hasKey $affinity "podAffinity")) (not (hasKey $affinity "podAntiAffinity")) -}}
{{- $term := dict "labelSelector" (dict "matchLabels" (include "vcpo-rl.selectorLabels" (dict "ctx" . "component" "learner") | fromYaml)) "matchLabelKeys" (list "ray.io/cluster") "topologyKey" "kubernetes.io/hostname" -}}
{{- if $v.learner.spreadAcrossNodes -}}
{{- $_ := set $affinity "podAntiAffinity" (dict "preferredDuringSchedulingIgnoredDuringExecution" (list (dict "weight" 100 "podAffinityTerm" $term))) -}}
{{- else -}}
{{- $_ := set $affinity "podAffinity" (dict "requiredDuringSchedulingIgnoredDuringExecution" (list $term)) -}}
{{- end -}}
{{- end -}}
{{- toYaml $affinity -}}
{{- end -}}

{{/*
One Ray pod template. Arguments: dict "ctx" . "component" <name> "container" <name> "resources" <values>
"gpus" <int> "ports" <list of {name, containerPort}> "env" <extra env list> "scheduling" <values with
nodeSelector/tolerations/affinity> "grace" <seconds or 0>; optional "securityContext" <the container's>
*/}}
{{- define "vcpo-rl.rayPod" -}}
{{- $ctx := .ctx -}}
metadata:
  labels:
    {{- include "vcpo-rl.labels" $ctx | nindent 4 }}
    {{- include "vcpo-rl.selectorLabels" (dict "ctx" $ctx "component" .component) | nindent 4 }}
  annotations:
    checksum/run-config: {{ include "vcpo-rl.runToml" $ctx | sha256sum }}
    {{- with $ctx.Values.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  {{- with $ctx.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if .grace }}
  terminationGracePeriodSeconds: {{ int .grace }}
  {{- end }}
  containers:
    - name: {{ .container }}
      image: {{ include "vcpo-rl.image" $ctx }}
      imagePullPolicy: {{ $ctx.Values.image.pullPolicy }}
      {{- with .securityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      ports:
        {{- toYaml .ports | nindent 8 }}
      env:
        {{- include "vcpo-rl.rayEnv" $ctx | nindent 8 }}
        {{- with .env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      resources:
        {{- include "vcpo-rl.resourcesWithGpus" (dict "resources" .resources "gpus" .gpus) | nindent 8 }}
      volumeMounts:
        {{- include "vcpo-rl.rayVolumeMounts" $ctx | nindent 8 }}
        {{- if has .component (list "sampler" "evaluator") }}
        {{- range include "vcpo-rl.envTokenMounts" $ctx | fromYamlArray }}
        - name: {{ .volume }}
          mountPath: {{ .dir }}
          readOnly: true
        {{- end }}
        {{- end }}
      lifecycle:
        preStop:
          exec:
            command: ["/bin/sh", "-c", "ray stop"]
  volumes:
    {{- include "vcpo-rl.rayVolumes" $ctx | nindent 4 }}
    {{- if has .component (list "sampler" "evaluator") }}
    {{- range include "vcpo-rl.envTokenMounts" $ctx | fromYamlArray }}
    - name: {{ .volume }}
      secret:
        secretName: {{ .secret }}
        items:
          - key: {{ .key }}
            path: token
        defaultMode: 0440
    {{- end }}
    {{- end }}
  {{- with .scheduling.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with include "vcpo-rl.tolerations" (dict "ctx" $ctx "own" .scheduling.tolerations) | fromYamlArray }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .scheduling.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}

{{/*
The RayCluster the RayJob owns: the head (launcher, Ray control plane, weight broker) and one worker group
per service (the evaluator's only with a dedicated evaluator). Each group offers a custom Ray resource that
only its service asks for (the run file's <service>.ray_resources), so Ray places every service on its own
pods: the Services below select them by label, and the ports in the run file are the pods' ports.
*/}}
{{- define "vcpo-rl.rayClusterSpec" -}}
{{- $v := .Values -}}
{{- $p := include "vcpo-rl.ports" . | fromJson -}}
{{- $learnerPods := div (int $v.learner.ranks) (int $v.learner.ranksPerPod) -}}
{{- if ne (mul $learnerPods (int $v.learner.ranksPerPod)) (int $v.learner.ranks) -}}
{{- fail (printf "learner.ranks = %d is not a multiple of learner.ranksPerPod = %d: every learner pod holds the same number of ranks" (int $v.learner.ranks) (int $v.learner.ranksPerPod)) -}}
{{- end -}}
rayVersion: {{ $v.rayCluster.rayVersion | quote }}
enableInTreeAutoscaling: {{ $v.rayCluster.autoscaling }}
{{- if $v.rayCluster.autoscaling }}
autoscalerOptions:
  upscalingMode: Default
  idleTimeoutSeconds: 300
{{- end }}
headGroupSpec:
  rayStartParams:
    {{- toYaml (merge (dict) $v.head.rayStartParams (dict "dashboard-host" "0.0.0.0")) | nindent 4 }}
  resources:
    vcpo_broker: "1"
  template:
    {{- $ports := list (dict "name" "gcs" "containerPort" 6379) (dict "name" "dashboard" "containerPort" 8265) (dict "name" "client" "containerPort" 10001) (dict "name" "broker-grpc" "containerPort" (int $p.brokerGrpc)) (dict "name" "broker-data" "containerPort" (int $p.brokerData)) (dict "name" "vcpo-metrics" "containerPort" (int $p.brokerMetrics)) (dict "name" "launch-metrics" "containerPort" (int $p.launcherMetrics)) }}
    {{- $env := list (dict "name" "VCPO_WEIGHT_BROKER__ADVERTISE_HOST" "value" "$(POD_IP)") }}
    {{- include "vcpo-rl.rayPod" (dict "ctx" . "component" "head" "container" "ray-head" "resources" $v.head.resources "gpus" 0 "ports" $ports "env" $env "scheduling" $v.head "grace" (add (int $v.rayJob.stopGracePeriodSeconds) 60)) | nindent 4 }}
workerGroupSpecs:
  - groupName: sampler
    replicas: {{ int $v.sampler.replicas }}
    minReplicas: {{ int $v.sampler.replicas }}
    maxReplicas: {{ int $v.sampler.replicas }}
    rayStartParams: {}
    resources:
      vcpo_sampler: "1"
    template:
      {{- $ports := list (dict "name" "vcpo-grpc" "containerPort" (int $p.samplerGrpc)) (dict "name" "vcpo-metrics" "containerPort" (int $p.samplerMetrics)) }}
      {{- if $v.agents.enabled }}
      {{- $ports = append $ports (dict "name" "vcpo-agents" "containerPort" (int $p.samplerAgents)) }}
      {{- end }}
      {{- include "vcpo-rl.rayPod" (dict "ctx" . "component" "sampler" "container" "ray-worker" "resources" $v.sampler.resources "gpus" (int $v.sampler.gpusPerReplica) "ports" $ports "env" (list) "scheduling" $v.sampler "grace" 0 "securityContext" $v.sampler.securityContext) | nindent 6 }}
  - groupName: learner
    replicas: {{ $learnerPods }}
    minReplicas: {{ $learnerPods }}
    maxReplicas: {{ $learnerPods }}
    rayStartParams: {}
    resources:
      vcpo_learner: {{ int $v.learner.ranksPerPod | toString | quote }}
    template:
      {{- $ports := list (dict "name" "vcpo-grpc" "containerPort" (int $p.learnerGrpc)) (dict "name" "vcpo-metrics" "containerPort" (int $p.learnerMetrics)) (dict "name" "weight-group" "containerPort" (int $v.weightBroker.group.port)) }}
      {{- include "vcpo-rl.rayPod" (dict "ctx" . "component" "learner" "container" "ray-worker" "resources" $v.learner.resources "gpus" (mul (int $v.learner.ranksPerPod) (int $v.learner.gpusPerRank)) "ports" $ports "env" (list) "scheduling" (merge (dict "affinity" (include "vcpo-rl.learnerAffinity" . | fromYaml)) $v.learner) "grace" 0 "securityContext" $v.learner.securityContext) | nindent 6 }}
  - groupName: reward
    replicas: {{ ternary (int $v.reward.minReplicas) (int $v.reward.maxReplicas) $v.rayCluster.autoscaling }}
    minReplicas: {{ ternary (int $v.reward.minReplicas) (int $v.reward.maxReplicas) $v.rayCluster.autoscaling }}
    maxReplicas: {{ int $v.reward.maxReplicas }}
    rayStartParams: {}
    resources:
      vcpo_reward: "1"
    template:
      {{- $ports := list (dict "name" "vcpo-grpc" "containerPort" (int $p.rewardGrpc)) (dict "name" "vcpo-metrics" "containerPort" (int $p.rewardMetrics)) }}
      {{- include "vcpo-rl.rayPod" (dict "ctx" . "component" "reward" "container" "ray-worker" "resources" $v.reward.resources "gpus" 0 "ports" $ports "env" (list) "scheduling" $v.reward "grace" 0) | nindent 6 }}
{{- if include "vcpo-rl.dedicatedEvaluator" . }}
{{- if eq ((include "vcpo-rl.runToml" . | fromToml).weight_broker.transport | default "") "collective" }}
{{- fail "evaluation.placement = dedicated with weightBroker.transport = collective: the dedicated evaluator fetches its versions from the broker, which is not in the weight group and holds only the versions published through it; set evaluation.placement = shared (the samplers evaluate) or weightBroker.transport = tcp" }}
{{- end }}
  - groupName: evaluator
    replicas: 1
    minReplicas: 1
    maxReplicas: 1
    rayStartParams: {}
    resources:
      vcpo_evaluator: "1"
    template:
      {{- $ev := $v.evaluation.evaluator -}}
      {{- $scheduling := dict "nodeSelector" (default $v.sampler.nodeSelector $ev.nodeSelector) "tolerations" (default $v.sampler.tolerations $ev.tolerations) "affinity" (default $v.sampler.affinity $ev.affinity) }}
      {{- $ports := list (dict "name" "vcpo-metrics" "containerPort" (int $p.evaluatorMetrics)) }}
      {{- include "vcpo-rl.rayPod" (dict "ctx" . "component" "evaluator" "container" "ray-worker" "resources" (default $v.sampler.resources $ev.resources) "gpus" (int $v.sampler.gpusPerReplica) "ports" $ports "env" (list) "scheduling" $scheduling "grace" 0 "securityContext" (default $v.sampler.securityContext $ev.securityContext)) | nindent 6 }}
{{- end }}
{{- end -}}


{{/*
"true" when the run has a dedicated evaluator: evaluation.placement = dedicated and sets in the run file
(from evaluation.sets or extraConfig, so read back from the merged file).
*/}}
{{- define "vcpo-rl.dedicatedEvaluator" -}}
{{- $ev := (include "vcpo-rl.runToml" . | fromToml).evaluation -}}
{{- if and $ev.sets (eq $ev.placement "dedicated") -}}true{{- end -}}
{{- end -}}

{{/* What the RayJob runs: the launcher, against the cluster it runs in (deploy/launch.py). */}}
{{- define "vcpo-rl.entrypoint" -}}
python -m deploy.launch --config /etc/vcpo/run.toml --launcher.ray_address auto
{{- end -}}

{{/*
The RayJob's name: the prefix and a hash of everything that defines the job (run file, cluster spec,
entrypoint, rayJob.redeployKey), at most 47 characters (KubeRay's limit for RayJob names).
*/}}
{{- define "vcpo-rl.jobName" -}}
{{- $hash := printf "%s\n%s\n%s\n%s" (include "vcpo-rl.runToml" .) (include "vcpo-rl.rayClusterSpec" .) (include "vcpo-rl.entrypoint" .) .Values.rayJob.redeployKey | sha256sum | trunc 8 -}}
{{- printf "%s-%s" (include "vcpo-rl.fullname" . | trunc 38 | trimSuffix "-") $hash -}}
{{- end -}}

{{/*
The Secrets of environments[].authTokenSecret, as [{volume, dir, secret, key}]: each key is mounted read-only as
<dir>/token in the pods that register environments (the samplers' and a dedicated evaluator's, no others), where
the run file's auth_token_file points; the token stays out of the run file and out of the pods' environment.
*/}}
{{- define "vcpo-rl.envTokenMounts" -}}
{{- $out := list }}
{{- range .Values.environments }}
{{- if .authTokenSecret }}
{{- $out = append $out (dict "volume" (printf "env-token-%s" .name) "dir" (include "vcpo-rl.envTokenDir" .name) "secret" .authTokenSecret.name "key" (default "token" .authTokenSecret.key)) }}
{{- end }}
{{- end }}
{{- toYaml $out }}
{{- end -}}

{{/* Where environment <name>'s token Secret is mounted. */}}
{{- define "vcpo-rl.envTokenDir" -}}
{{- printf "/etc/vcpo/env-tokens/%s" . -}}
{{- end -}}

{{/*
The TLS Secrets given in values, as [{volume, dir, secret}]: each is mounted read-only at /etc/vcpo/tls/<dir>,
where the VCPO_SAMPLER__*_TLS__* variables of vcpo-rl.rayEnv point.
*/}}
{{- define "vcpo-rl.tlsMounts" -}}
{{- $out := list }}
{{- range $key, $dir := dict "apiSecret" "api" "clientCaSecret" "client-ca" "envCaSecret" "env-ca" "envClientSecret" "env-client" }}
{{- $secret := get $.Values.tls $key }}
{{- if $secret }}
{{- $out = append $out (dict "volume" (printf "tls-%s" $dir) "dir" $dir "secret" $secret) }}
{{- end }}
{{- end }}
{{- toYaml $out }}
{{- end -}}
