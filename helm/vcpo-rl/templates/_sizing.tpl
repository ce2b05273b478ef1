{{/*
Memory the model's weights take in the pods, checked at install so that an undersized pod fails here, with
the value to raise, instead of being OOM-killed at its first weight update (docs/deploy.md, "Memory and
/dev/shm"). W = one version of the weights = modelSize.parameters × 10^9 × modelSize.dtypeBytes. A LoRA run
whose versions are its adapters (learner.lora.rank > 0, publish = adapter) with modelSize.adapterParameters set
counts V = that many millions × modelSize.dtypeBytes in W's place wherever a version is held (the staged and
previous versions, the adapter's directory in /dev/shm, the broker's); a sampler without GPUs holds the frozen
base in its own process, + W. Without modelSize.adapterParameters every version counts as W.

  sampler pod (and a dedicated evaluator's)  3 W + 6Gi + 2Gi per GPU   the staged version, the previous one
                                                                      (kept to roll back a failed load) and
                                                                      the /dev/shm file vLLM's workers read
                                                                      it from (tmpfs counts as the pod's
                                                                      memory); the engine's processes
                                                                      (without GPUs: 2 W, no file, + 8Gi)
    with transport collective under NCCL    + 0                      each GPU worker receives the whole
    (a GPU learner: group_backend auto)                               broadcast version into buffers on its
                                                                      own GPU and the engine loads it from
                                                                      there (receiver.py): no host memory.
                                                                      Its room on the GPU, beside the
                                                                      engine's gpu_memory_utilization, is
                                                                      checked by vcpo-rl.checkHardware
    with transport collective over gloo     + W per GPU (1 without)   each engine worker receives the whole
    (a CPU learner, group_backend gloo)                               broadcast version into host memory, its
                                                                      own copy, kept until the next. The
                                                                      evaluator takes its versions from the
                                                                      broker: never counted
  /dev/shm (rayCluster.shmSize)              W + 4Gi                  that file, and NCCL's, vLLM's and
                                                                      Ray's own segments
  learner pod                                6Gi + 2Gi per rank       the ranks' processes (their weights are
                                                                      on the GPUs, or in the CPU learner's
                                                                      partitions, ZeRO-3)
    with transport collective                + W                      learner rank 0 stages each version in
                                                                      host memory (page-locked under CUDA)
                                                                      and keeps that buffer for the run, to
                                                                      broadcast from while the next step runs
                                                                      (collective.py); every learner pod is
                                                                      the same, so each is checked for it
  head pod                                   (retain + 1) W + 8Gi     the broker's retained versions and the
                                                                      one being published, in memory
                                                                      (storage = memory); the launcher and
                                                                      Ray's control plane
  shared volume, if the chart creates it     (retain + 1) W           the versions, with storage = disk
                                                                      (checkpoints and the hub cache come
                                                                      on top)

Every minimum is rounded up to whole Gi.
*/}}

{{- define "vcpo-rl.sizing.engineGi" -}}6{{- end -}}
{{- define "vcpo-rl.sizing.perGpuGi" -}}2{{- end -}}
{{- define "vcpo-rl.sizing.shmHeadroomGi" -}}4{{- end -}}
{{- define "vcpo-rl.sizing.headGi" -}}8{{- end -}}
{{- define "vcpo-rl.sizing.learnerGi" -}}6{{- end -}}
{{- define "vcpo-rl.sizing.perRankGi" -}}2{{- end -}}

{{/* A Kubernetes quantity (48Gi, 64G, 51539607552, ...) in GiB, as a float. */}}
{{- define "vcpo-rl.gib" -}}
{{- $q := toString . -}}
{{- $suffixes := dict "" 1.0 "m" 0.001 "k" 1000.0 "M" 1000000.0 "G" 1000000000.0 "T" 1000000000000.0 "P" 1000000000000000.0 "E" 1000000000000000000.0 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 -}}
{{- $number := regexFind `^[+]?[0-9.]+([eE][-+]?[0-9]+)?` $q -}}
{{- $suffix := trimPrefix $number $q -}}
{{- if or (not $number) (not (hasKey $suffixes $suffix)) -}}
{{- fail (printf "%q is not a Kubernetes quantity" $q) -}}
{{- end -}}
{{- divf (mulf (float64 $number) (get $suffixes $suffix)) 1073741824.0 -}}
{{- end -}}

{{/*
The model's parameters in billions: modelSize.parameters, else read from run.model's name (Qwen2.5-7B: 7,
SmolLM2-135M: 0.135) plus 10%, since names round down (Qwen2.5-7B has 7.6B); 0 for the tiny built-in model.
*/}}
{{- define "vcpo-rl.sizing.billions" -}}
{{- $v := .Values -}}
{{- if gt (float64 $v.modelSize.parameters) 0.0 -}}
{{- float64 $v.modelSize.parameters -}}
{{- else if not $v.run.model -}}
0
{{- else -}}
{{- $name := $v.run.model | trimSuffix "/" | splitList "/" | last -}}
{{- $size := regexFind `(^|[-_])[0-9]+(\.[0-9]+)?[BbMm]($|[-_.])` $name -}}
{{- if not $size -}}
{{- fail (printf "run.model = %q does not say its size in its name (like Qwen2.5-7B): set modelSize.parameters to its parameter count in billions, which the chart checks the pods' memory against (docs/deploy.md, \"Memory and /dev/shm\")" $v.run.model) -}}
{{- end -}}
{{- $number := float64 (regexFind `[0-9]+(\.[0-9]+)?` $size) -}}
{{- $unit := ternary 0.001 1.0 (contains "M" (upper $size)) -}}
{{- mulf $number $unit 1.1 -}}
{{- end -}}
{{- end -}}

{{/*
The minimums, in whole Gi, as JSON: weightsGi (W, a float), sampler, evaluator, shm, head, learner, volume;
received, the versions the weight group's receivers keep in the sampler pod's host memory (0 under NCCL);
receivedOnGpus, whether each sampler GPU worker receives versions into its own GPU instead (collective, NCCL).
*/}}
{{- define "vcpo-rl.sizing" -}}
{{- $v := .Values -}}
{{- $cfg := include "vcpo-rl.runToml" . | fromToml -}}
{{- $wb := $cfg.weight_broker -}}
{{- $w := divf (mulf (float64 (include "vcpo-rl.sizing.billions" .)) 1000000000.0 (float64 $v.modelSize.dtypeBytes)) 1073741824.0 -}}
{{- /* adapter versions (services/common/lora.py: rank > 0 and publish = adapter, its default) of a known
size stand in for W wherever a version is held; the frozen base stays on the GPUs, or in a CPU engine */ -}}
{{- $lora := dig "learner" "lora" dict $cfg -}}
{{- $adapterMillions := float64 (default 0 $v.modelSize.adapterParameters) -}}
{{- $adapters := and (gt (int (dig "rank" 0 $lora)) 0) (eq (dig "publish" "adapter" $lora) "adapter") (gt $adapterMillions 0.0) -}}
{{- $version := ternary (divf (mulf $adapterMillions 1000000.0 (float64 $v.modelSize.dtypeBytes)) 1073741824.0) $w $adapters -}}
{{- $gpus := int $v.sampler.gpusPerReplica -}}
{{- $base := ternary $w 0.0 (and $adapters (eq $gpus 0)) -}}
{{- $copies := ternary 3 2 (gt $gpus 0) -}}
{{- $collective := eq $wb.transport "collective" -}}
{{- /* the weight group's backend: auto gives NCCL with a GPU learner (group_control.py,
coordinator_from_config). Under NCCL each GPU worker receives a version into buffers on its own GPU
(receiver.py), no host memory; over gloo, or in a CPU sampler, each worker receives it into its own host
buffers */ -}}
{{- $groupBackend := dig "group_backend" "auto" $wb -}}
{{- $nccl := or (eq $groupBackend "nccl") (and (eq $groupBackend "auto") (gt (float64 $cfg.learner.gpus_per_rank) 0.0)) -}}
{{- $received := ternary (ternary 0 (max 1 $gpus) (and $nccl (gt $gpus 0))) 0 $collective -}}
{{- $engine := add (include "vcpo-rl.sizing.engineGi" .) (mul (include "vcpo-rl.sizing.perGpuGi" .) (max 1 $gpus)) -}}
{{- $retained := add1 (int $wb.retain_versions) -}}
{{- $inMemory := eq $wb.storage "memory" -}}
{{- $head := int (include "vcpo-rl.sizing.headGi" .) -}}
{{- dict
  "weightsGi" $w
  "versionGi" $version
  "adapters" $adapters
  "copies" $copies
  "received" $received
  "receivedOnGpus" (and $collective $nccl (gt $gpus 0))
  "engineGi" $engine
  "retained" $retained
  "inMemory" $inMemory
  "sampler" (ceil (addf (mulf (add $copies $received) $version) $base $engine) | int)
  "evaluator" (ceil (addf (mulf $copies $version) $base $engine) | int)
  "shm" (ternary (ceil (addf $version (include "vcpo-rl.sizing.shmHeadroomGi" .)) | int) 0 (gt $gpus 0))
  "head" (ternary (ceil (addf (mulf $retained $version) $head) | int) $head $inMemory)
  "learnerStaging" $collective
  "learner" (ceil (addf (ternary $version 0.0 $collective) (add (include "vcpo-rl.sizing.learnerGi" .) (mul (include "vcpo-rl.sizing.perRankGi" .) (int $v.learner.ranksPerPod)))) | int)
  "volume" (ternary 0 (ceil (mulf $retained $version) | int) $inMemory)
  | toJson -}}
{{- end -}}

{{/*
Fails when a memory request or limit of `resources` is below `min` Gi. Arguments: dict "key" <values path of
the resources> "resources" <values> "min" <Gi> "why" <what the minimum is made of>
*/}}
{{- define "vcpo-rl.sizing.checkMemory" -}}
{{- $args := . -}}
{{- range $kind := list "requests" "limits" -}}
{{- $memory := dig $kind "memory" "" (default dict $args.resources) -}}
{{- if and $memory (lt (float64 (include "vcpo-rl.gib" $memory)) (float64 $args.min)) -}}
{{- fail (printf "%s.%s.memory = %v is below the %dGi %s; raise %s.%s.memory to at least %dGi" $args.key $kind $memory (int $args.min) $args.why $args.key $kind (int $args.min)) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "vcpo-rl.checkSizes" -}}
{{- $v := .Values -}}
{{- $s := include "vcpo-rl.sizing" . | fromJson -}}
{{- $source := ternary "modelSize.parameters" "its name + 10%; modelSize.parameters sets the exact count" (gt (float64 $v.modelSize.parameters) 0.0) -}}
{{- $model := printf "run.model %q (%.3gB parameters from %s; × %v bytes = %.1fGiB per version)" $v.run.model (float64 (include "vcpo-rl.sizing.billions" .)) $source $v.modelSize.dtypeBytes (float64 $s.weightsGi) -}}
{{- if $s.adapters -}}
{{- $model = printf "run.model %q's LoRA adapter versions (modelSize.adapterParameters = %vM parameters × %v bytes = %.2fGiB per version)" $v.run.model $v.modelSize.adapterParameters $v.modelSize.dtypeBytes (float64 $s.versionGi) -}}
{{- end -}}
{{- $copies := ternary "3 copies of a version (the staged one, the previous one, the /dev/shm file vLLM's workers read)" "2 copies of a version (the staged one, the previous one)" (eq (int $s.copies) 3) -}}
{{- if and $s.adapters (eq (int $s.copies) 2) -}}
{{- $copies = printf "the frozen base in the engine (%.1fGiB) + %s" (float64 $s.weightsGi) $copies -}}
{{- end -}}
{{- $why := printf "a sampler pod needs for %s: %s + %dGi for the engine's processes" $model $copies (int $s.engineGi) -}}
{{- $received := "" -}}
{{- if gt (int $s.received) 0 -}}
{{- $received = printf " + %d more, the weight group's broadcast as each engine worker receives it into host memory (weightBroker.transport collective over gloo: a CPU learner or sampler)" (int $s.received) -}}
{{- end -}}
{{- include "vcpo-rl.sizing.checkMemory" (dict "key" "sampler.resources" "resources" $v.sampler.resources "min" $s.sampler "why" (printf "%s%s" $why $received)) -}}
{{- if and (include "vcpo-rl.dedicatedEvaluator" .) $v.evaluation.evaluator.resources -}}
{{- include "vcpo-rl.sizing.checkMemory" (dict "key" "evaluation.evaluator.resources" "resources" $v.evaluation.evaluator.resources "min" $s.evaluator "why" (replace "a sampler pod" "the evaluator's pod" $why)) -}}
{{- end -}}
{{- if and (gt (int $s.shm) 0) (lt (float64 (include "vcpo-rl.gib" $v.rayCluster.shmSize)) (float64 $s.shm)) -}}
{{- fail (printf "rayCluster.shmSize = %v is below the %dGi /dev/shm needs for %s: one version's file, which vLLM's workers read each new version from, + %sGi for NCCL, vLLM and Ray; raise rayCluster.shmSize to at least %dGi" $v.rayCluster.shmSize (int $s.shm) $model (include "vcpo-rl.sizing.shmHeadroomGi" .) (int $s.shm)) -}}
{{- end -}}
{{- $held := ternary (printf "%d versions in the weight broker's memory (weightBroker.retainVersions + the one being published) + %sGi for the launcher and Ray's control plane" (int $s.retained) (include "vcpo-rl.sizing.headGi" .)) (printf "%sGi for the launcher, Ray's control plane and the weight broker (its versions are on the shared volume)" (include "vcpo-rl.sizing.headGi" .)) $s.inMemory -}}
{{- include "vcpo-rl.sizing.checkMemory" (dict "key" "head.resources" "resources" $v.head.resources "min" $s.head "why" (printf "the head pod needs for %s: %s" $model $held)) -}}
{{- $processes := printf "%sGi + %sGi for each of its %d ranks' processes" (include "vcpo-rl.sizing.learnerGi" .) (include "vcpo-rl.sizing.perRankGi" .) (int $v.learner.ranksPerPod) -}}
{{- $staging := ternary (printf "the version learner rank 0 stages in host memory to broadcast from (weightBroker.transport collective; every learner pod is sized alike) + %s" $processes) $processes $s.learnerStaging -}}
{{- include "vcpo-rl.sizing.checkMemory" (dict "key" "learner.resources" "resources" $v.learner.resources "min" $s.learner "why" (printf "a learner pod needs for %s: %s" $model $staging)) -}}
{{- if and (gt (int $s.volume) 0) (not $v.sharedStorage.existingClaim) (lt (float64 (include "vcpo-rl.gib" $v.sharedStorage.size)) (float64 $s.volume)) -}}
{{- fail (printf "sharedStorage.size = %v is below the %dGi the weight broker's %d versions on the shared volume take for %s (checkpoints and the hub cache need more on top); raise sharedStorage.size to at least %dGi" $v.sharedStorage.size (int $s.volume) (int $s.retained) $model (int $s.volume)) -}}
{{- end -}}
{{- end -}}
