{{/*
Names. The prefix is kept to 40 characters so that every suffixed name (-weight-broker-metrics, the
RayJob's -<hash>, KubeRay's -<random>-head-svc) stays a valid 63-character DNS label.
*/}}
{{- define "vcpo-rl.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "vcpo-rl.labels" -}}
app.kubernetes.io/name: {{ default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/*
Selector labels of one component's pods: chart-owned keys only, because KubeRay writes its own
app.kubernetes.io/* and ray.io/* labels on the Ray pods it creates.
*/}}
{{- define "vcpo-rl.selectorLabels" -}}
vcpo.io/release: {{ .ctx.Release.Name }}
vcpo.io/component: {{ .component }}
{{- end -}}

{{- define "vcpo-rl.runId" -}}
{{- default .Release.Name .Values.run.runId -}}
{{- end -}}

{{- define "vcpo-rl.runDir" -}}
{{- default (printf "%s/runs/%s" (trimSuffix "/" .Values.sharedStorage.mountPath) (include "vcpo-rl.runId" .)) .Values.run.runDir -}}
{{- end -}}

{{/*
The project's image. No public registry carries it, so image.repository has no default: without it the install
fails here (before any other check), printing how to build and push it.
*/}}
{{- define "vcpo-rl.checkImage" -}}
{{- if not .Values.image.repository -}}
{{- $ref := printf "<registry>/vcpo-rl-gpu:%s" (default .Chart.AppVersion .Values.image.tag) -}}
{{- fail (printf "image.repository is not set, and no public registry carries the project's image: build it from the repository root and push it to a registry the cluster pulls from,\n  docker build -f deploy/docker/Dockerfile.gpu -t %s . && docker push %s\n(deploy/docker/Dockerfile.cpu for a cluster without GPUs), then install with --set image.repository=<registry>/vcpo-rl-gpu (and image.tag, default: the chart's appVersion %s); docs/deploy.md, step 1" $ref $ref .Chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{- define "vcpo-rl.image" -}}
{{- include "vcpo-rl.checkImage" . -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Ports the services bind in their pods (written into the run file; one service per pod). */}}
{{- define "vcpo-rl.ports" -}}
{{- dict "samplerGrpc" 50051 "samplerAgents" 8000 "samplerMetrics" 9101 "learnerGrpc" 50054 "learnerMetrics" 9102 "rewardGrpc" 50053 "rewardMetrics" 9103 "brokerGrpc" 50052 "brokerData" 50055 "brokerMetrics" 9104 "evaluatorMetrics" 9105 "launcherMetrics" 9106 | toJson -}}
{{- end -}}

{{/* Secret names and keys. */}}
{{- define "vcpo-rl.apiTokenSecret" -}}
{{- default (printf "%s-api-token" (include "vcpo-rl.fullname" .)) .Values.apiToken.existingSecret -}}
{{- end -}}
{{- define "vcpo-rl.apiTokenKey" -}}
{{- ternary .Values.apiToken.existingSecretKey "token" (ne .Values.apiToken.existingSecret "") -}}
{{- end -}}

{{- define "vcpo-rl.redisExternal" -}}
{{- if or .Values.redis.external.url .Values.redis.external.existingSecret -}}true{{- end -}}
{{- end -}}
{{- define "vcpo-rl.redisPasswordSecret" -}}
{{- default (printf "%s-redis" (include "vcpo-rl.fullname" .)) .Values.redis.auth.existingSecret -}}
{{- end -}}
{{- define "vcpo-rl.redisPasswordKey" -}}
{{- ternary .Values.redis.auth.existingSecretPasswordKey "password" (ne .Values.redis.auth.existingSecret "") -}}
{{- end -}}
{{- define "vcpo-rl.redisUrlSecret" -}}
{{- default (printf "%s-redis-url" (include "vcpo-rl.fullname" .)) .Values.redis.external.existingSecret -}}
{{- end -}}
{{- define "vcpo-rl.redisUrlKey" -}}
{{- ternary .Values.redis.external.existingSecretKey "url" (ne .Values.redis.external.existingSecret "") -}}
{{- end -}}

{{- define "vcpo-rl.hubEnabled" -}}
{{- if or .Values.hub.token .Values.hub.existingSecret -}}true{{- end -}}
{{- end -}}
{{- define "vcpo-rl.hubSecret" -}}
{{- default (printf "%s-hub" (include "vcpo-rl.fullname" .)) .Values.hub.existingSecret -}}
{{- end -}}
{{- define "vcpo-rl.hubKey" -}}
{{- ternary .Values.hub.existingSecretKey "token" (ne .Values.hub.existingSecret "") -}}
{{- end -}}

{{- define "vcpo-rl.dataClaim" -}}
{{- default (printf "%s-data" (include "vcpo-rl.fullname" .)) .Values.sharedStorage.existingClaim -}}
{{- end -}}

{{/*
A generated secret value that survives upgrades: the given value, else the one already in the Secret
(`lookup`; empty under `helm template`), else a new random one. Include it once per render.
Arguments: dict "ctx" . "name" <secret> "key" <key> "given" <value>
*/}}
{{- define "vcpo-rl.secretValue" -}}
{{- if .given -}}
{{- .given -}}
{{- else -}}
{{- $existing := lookup "v1" "Secret" .ctx.Release.Namespace .name -}}
{{- if and $existing $existing.data (hasKey $existing.data .key) -}}
{{- index $existing.data .key | b64dec -}}
{{- else -}}
{{- randAlphaNum 48 -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
Deep-sets every key of .src into .dst (tables merge, anything else replaces). Not mergeOverwrite: that
skips zero values, so `k = 0` or `temperature = 0.0` in extraConfig would be silently dropped.
*/}}
{{- define "vcpo-rl.overlay" -}}
{{- $dst := .dst -}}
{{- range $key, $value := .src -}}
{{- if and (kindIs "map" $value) (kindIs "map" (get $dst $key)) -}}
{{- include "vcpo-rl.overlay" (dict "dst" (get $dst $key) "src" $value) -}}
{{- else -}}
{{- $_ := set $dst $key $value -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Endpoint of an environment the chart runs (its Service). */}}
{{- define "vcpo-rl.envServerName" -}}
{{- printf "%s-env-%s" (include "vcpo-rl.fullname" .ctx) .name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The run file every service reads, as TOML: the values mapped onto the config sections (services/<name>/config.py),
the keys the chart owns (sizes, GPUs, ports, Ray resources that pin each service to its pods), then
extraConfig deep-merged over it. The checks the learner and deploy/config.py make at start-up are made here
too, so a run that would be refused fails at `helm install` instead of after its pods start.
*/}}
{{- define "vcpo-rl.runToml" -}}
{{- $v := .Values -}}
{{- $p := include "vcpo-rl.ports" . | fromJson -}}
{{- $gpus := int $v.sampler.gpusPerReplica -}}
{{- $envs := list -}}
{{- range $v.environments -}}
{{- $e := dict "name" .name -}}
{{- if .server -}}
{{- $_ := set $e "endpoint" (printf "%s.%s.svc:%d" (include "vcpo-rl.envServerName" (dict "ctx" $ "name" .name)) $.Release.Namespace (int (default 50070 .server.port))) -}}
{{- else if .endpoint -}}
{{- $_ := set $e "endpoint" .endpoint -}}
{{- end -}}
{{- with .builtin }}{{ $_ := set $e "builtin" . }}{{ end -}}
{{- with .scorer }}{{ $_ := set $e "scorer" . }}{{ end -}}
{{- with .toolParser }}{{ $_ := set $e "tool_parser" . }}{{ end -}}
{{- with .maxTurns }}{{ $_ := set $e "max_turns" (int .) }}{{ end -}}
{{- with .maxConcurrency }}{{ $_ := set $e "max_concurrency" (int .) }}{{ end -}}
{{- with .maxEpisodeTokens }}{{ $_ := set $e "max_episode_tokens" (int .) }}{{ end -}}
{{- with .resetTimeoutSeconds }}{{ $_ := set $e "reset_timeout_seconds" (float64 .) }}{{ end -}}
{{- with .stepTimeoutSeconds }}{{ $_ := set $e "step_timeout_seconds" (float64 .) }}{{ end -}}
{{- with .weight }}{{ $_ := set $e "weight" (float64 .) }}{{ end -}}
{{- if and .builtin (or .tls .authTokenSecret) -}}
{{- fail (printf "environments %q: tls and authTokenSecret are for an endpoint or a server; builtin %q runs in the sampler" .name .builtin) -}}
{{- end -}}
{{- with .tls }}{{ $_ := set $e "tls" true }}{{ end -}}
{{- if .authTokenSecret }}{{ $_ := set $e "auth_token_file" (printf "%s/token" (include "vcpo-rl.envTokenDir" .name)) }}{{ end -}}
{{- $envs = append $envs $e -}}
{{- end -}}
{{- $setKeys := dict "name" "name" "dataset" "dataset" "split" "split" "promptField" "prompt_field" "answerField" "answer_field" "scorer" "scorer" "environment" "environment" "samples" "n" "temperature" "temperature" "topP" "top_p" "maxTokens" "max_tokens" "limit" "limit" "every" "every" "correctAt" "correct_at" -}}
{{- $intKeys := list "samples" "maxTokens" "limit" "every" -}}
{{- $floatKeys := list "temperature" "topP" "correctAt" -}}
{{- $sets := list -}}
{{- range $v.evaluation.sets -}}
{{- $s := dict -}}
{{- range $key, $value := . -}}
{{- if has $key $intKeys -}}{{- $value = int $value -}}{{- else if has $key $floatKeys -}}{{- $value = float64 $value -}}{{- end -}}
{{- $_ := set $s (get $setKeys $key) $value -}}
{{- end -}}
{{- $sets = append $sets $s -}}
{{- end -}}
{{- $cfg := dict
  "run" (dict
    "run_id" (include "vcpo-rl.runId" .)
    "k" (int $v.run.k)
    "groups_per_step" (int $v.run.groupsPerStep)
    "model" $v.run.model
    "run_dir" (include "vcpo-rl.runDir" .)
    "seed" (int $v.run.seed))
  "streams" (dict
    "rollouts_maxlen" (int $v.streams.rolloutsMaxlen)
    "scored_maxlen" (int $v.streams.scoredMaxlen))
  "sampler" (dict
    "replicas" (int $v.sampler.replicas)
    "gpus_per_replica" (float64 $gpus)
    "tensor_parallel_size" (max 1 $gpus)
    "n" (int $v.sampler.groupSize)
    "temperature" (float64 $v.sampler.temperature)
    "max_tokens" (int $v.sampler.maxTokens)
    "max_model_len" (int $v.sampler.maxModelLen)
    "max_requests_in_flight" (int $v.sampler.maxRequestsInFlight)
    "gpu_memory_utilization" (float64 $v.sampler.gpuMemoryUtilization)
    "dtype" $v.sampler.dtype
    "weight_update" $v.sampler.weightUpdate
    "dataset" $v.data.dataset
    "prompt_field" $v.data.promptField
    "answer_field" $v.data.answerField
    "source_field" $v.data.sourceField
    "scorer_by_source" ($v.data.scorerBySource | default dict)
    "system_prompt" $v.data.systemPrompt
    "dataset_environment" $v.datasetEnvironment
    "environments" $envs
    "grpc_port" (int $p.samplerGrpc)
    "metrics_port" (int $p.samplerMetrics)
    "port_per_replica" false
    "ray_resources" (dict "vcpo_sampler" 1.0))
  "learner" (dict
    "num_ranks" (int $v.learner.ranks)
    "gpus_per_rank" (float64 $v.learner.gpusPerRank)
    "micro_batch_size" (int $v.learner.microBatchSize)
    "lr" (float64 $v.learner.lr)
    "objective" $v.learner.objective
    "objective_settings" ($v.learner.objectiveSettings | default dict)
    "checkpoint_every" (int $v.learner.checkpointEvery)
    "keep_checkpoints" (int $v.learner.keepCheckpoints)
    "grpc_port" (int $p.learnerGrpc)
    "metrics_port" (int $p.learnerMetrics)
    "ray_resources" (dict "vcpo_learner" 1.0))
  "reward" (dict
    "default_scorer" $v.reward.defaultScorer
    "workers" (int $v.reward.workers)
    "min_replicas" (int $v.reward.minReplicas)
    "max_replicas" (int $v.reward.maxReplicas)
    "grpc_port" (int $p.rewardGrpc)
    "metrics_port" (int $p.rewardMetrics)
    "serve_ports" "configured"
    "ray_resources" (dict "vcpo_reward" 1.0))
  "weight_broker" (dict
    "transport" $v.weightBroker.transport
    "retain_versions" (int $v.weightBroker.retainVersions)
    "storage" $v.weightBroker.storage
    "group_port" (int $v.weightBroker.group.port)
    "group_timeout_s" (float64 $v.weightBroker.group.timeoutSeconds)
    "group_form_timeout_s" (float64 $v.weightBroker.group.formTimeoutSeconds)
    "group_bucket_mb" (int $v.weightBroker.group.bucketMiB)
    "grpc_port" (int $p.brokerGrpc)
    "data_port" (int $p.brokerData)
    "metrics_port" (int $p.brokerMetrics)
    "ray_resources" (dict "vcpo_broker" 1.0))
  "agents" (dict
    "enabled" $v.agents.enabled
    "port" (int $p.samplerAgents)
    "episode_timeout_s" (float64 $v.agents.episodeTimeoutSeconds)
    "max_turns" (int $v.agents.maxTurns)
    "tool_parser" $v.agents.toolParser)
  "evaluation" (dict
    "sets" $sets
    "every" (int $v.evaluation.every)
    "at_start" $v.evaluation.atStart
    "placement" $v.evaluation.placement
    "max_delay_s" (float64 $v.evaluation.maxDelaySeconds)
    "max_requests_in_flight" (int $v.evaluation.maxRequestsInFlight)
    "gpus" (float64 $gpus)
    "metrics_port" (int $p.evaluatorMetrics)
    "ray_resources" (dict "vcpo_evaluator" 1.0))
  "launcher" (dict
    "max_steps" (int $v.run.maxSteps)
    "max_minutes" (float64 $v.run.maxMinutes)
    "max_restarts" (int $v.run.maxRestarts)
    "restart_backoff_s" (float64 $v.run.restartBackoffSeconds)
    "learner_hang_timeout_s" (float64 $v.run.learnerHangTimeoutSeconds)
    "metrics_port" (int $p.launcherMetrics))
-}}
{{- /* [learner.lora] only for a LoRA run: rank 0 leaves the table out (full fine-tuning, the learner's default) */ -}}
{{- $lora := $v.learner.lora | default dict -}}
{{- if gt (int (dig "rank" 0 $lora)) 0 -}}
{{- $_ := set $cfg.learner "lora" (dict
  "rank" (int $lora.rank)
  "alpha" (int $lora.alpha)
  "dropout" (float64 $lora.dropout)
  "target_modules" $lora.targetModules
  "publish" $lora.publish) -}}
{{- end -}}
{{- with $v.extraConfig -}}
{{- $extra := fromToml . -}}
{{- if hasKey $extra "Error" -}}
{{- fail (printf "extraConfig is not valid TOML: %s" (get $extra "Error")) -}}
{{- end -}}
{{- $owned := dict
  "run" (list "run_id" "run_dir" "redis_url")
  "sampler" (list "replicas" "gpus_per_replica" "tensor_parallel_size" "grpc_port" "metrics_port" "port_per_replica" "ray_resources" "api_token" "api_token_file")
  "learner" (list "num_ranks" "gpus_per_rank" "grpc_port" "metrics_port" "ray_resources")
  "reward" (list "min_replicas" "max_replicas" "grpc_port" "metrics_port" "serve_ports" "ray_resources")
  "weight_broker" (list "grpc_port" "data_port" "metrics_port" "ray_resources" "advertise_host" "group_port")
  "evaluation" (list "placement" "gpus" "metrics_port" "ray_resources")
  "launcher" (list "ray_address" "metrics_port")
  "agents" (list "port" "host" "advertise_host")
-}}
{{- range $section, $keys := $owned -}}
{{- $given := get $extra $section -}}
{{- if kindIs "map" $given -}}
{{- range $keys -}}
{{- if hasKey $given . -}}
{{- fail (printf "extraConfig sets %s.%s, which the chart derives from its values (pods, GPUs, ports, Ray resources, secrets): set it through values.yaml instead" $section .) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- include "vcpo-rl.overlay" (dict "dst" $cfg "src" $extra) -}}
{{- end -}}
{{- /* the cross-section checks of deploy/config.py SystemConfig, on the merged file */ -}}
{{- $held := mul (add1 (int $cfg.learner.checkpoint_every)) (int $cfg.run.groups_per_step) -}}
{{- if lt (int $cfg.streams.scored_maxlen) $held -}}
{{- fail (printf "streams.scored_maxlen = %d is less than (learner.checkpoint_every + 1) * run.groups_per_step = %d (values streams.scoredMaxlen, learner.checkpointEvery, run.groupsPerStep): the learner acknowledges scored groups only at a checkpoint, so the stream would fill up before the next one and the run would stall; raise streams.scoredMaxlen or lower learner.checkpointEvery" (int $cfg.streams.scored_maxlen) $held) -}}
{{- end -}}
{{- if lt (int $cfg.run.groups_per_step) (int $cfg.learner.num_ranks) -}}
{{- fail (printf "run.groupsPerStep = %d is less than learner.ranks = %d: every rank trains on whole groups, so each step needs one per rank" (int $cfg.run.groups_per_step) (int $cfg.learner.num_ranks)) -}}
{{- end -}}
{{- if gt (int $cfg.sampler.n) (int (dig "max_group_size" 64 $cfg.learner)) -}}
{{- fail (printf "sampler.n = %d exceeds learner.max_group_size = %d: the learner would reject every group" (int $cfg.sampler.n) (int (dig "max_group_size" 64 $cfg.learner))) -}}
{{- end -}}
{{- $cap := int (dig "max_requests_in_flight" 0 $cfg.sampler) -}}
{{- if and (gt $cap 0) (lt $cap (int $cfg.sampler.n)) -}}
{{- fail (printf "sampler.maxRequestsInFlight = %d is below sampler.groupSize = %d: no group could ever start; raise it to at least %d (or 0: the engine's batch limit)" $cap (int $cfg.sampler.n) (int $cfg.sampler.n)) -}}
{{- end -}}
{{- if and (gt (float64 $cfg.learner.gpus_per_rank) 0.0) (eq (float64 $cfg.sampler.gpus_per_replica) 0.0) -}}
{{- fail (printf "sampler.gpusPerReplica = 0 while learner.gpusPerRank = %v: on GPUs each sampler replica must hold the GPUs its engine uses, or every replica's vLLM engine opens cuda:0 beside the learner's ranks; set sampler.gpusPerReplica to at least 1 (its tensor parallelism), or learner.gpusPerRank = 0 for a run on CPUs" $v.learner.gpusPerRank) -}}
{{- end -}}
{{- if lt (int $cfg.reward.max_replicas) (int $cfg.reward.min_replicas) -}}
{{- fail (printf "reward.maxReplicas = %d is less than reward.minReplicas = %d" (int $cfg.reward.max_replicas) (int $cfg.reward.min_replicas)) -}}
{{- end -}}
{{- /* adapter versions travel through the broker (services/sampler/config.py, check_adapter_transport) */ -}}
{{- $adapter := dig "lora" (dict) $cfg.learner -}}
{{- if and (gt (int (dig "rank" 0 $adapter)) 0) (eq (toString (dig "publish" "adapter" $adapter)) "adapter") (eq (toString $cfg.weight_broker.transport) "collective") -}}
{{- fail (printf "learner.lora.rank = %d with learner.lora.publish = adapter: each policy version is the adapters alone, which the samplers load from the weight broker, and weightBroker.transport = collective broadcasts whole models into the samplers' GPUs (the launcher refuses the pair); set weightBroker.transport = tcp (adapter versions are megabytes: the broker's path carries them), or learner.lora.publish = merged (each version then the whole model with the adapters merged in)" (int (dig "rank" 0 $adapter))) -}}
{{- end -}}
{{- $envNames := list -}}
{{- range $cfg.sampler.environments }}{{ $envNames = append $envNames .name }}{{ end -}}
{{- with $cfg.sampler.dataset_environment -}}
{{- if not (has . $envNames) -}}
{{- fail (printf "datasetEnvironment = %q is not one of the environments: %v" . $envNames) -}}
{{- end -}}
{{- end -}}
{{- range $cfg.evaluation.sets -}}
{{- if and .environment (not (has .environment $envNames)) -}}
{{- fail (printf "evaluation set %q: environment %q is not one of the environments: %v" .name .environment $envNames) -}}
{{- end -}}
{{- end -}}
{{- toToml $cfg -}}
{{- end -}}
