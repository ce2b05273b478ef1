{{/*
The release against the GPU nodes it states (gpuNodes), checked at install: what Kubernetes would otherwise
leave pending (a pod of more GPUs than a node has, more GPUs than the nodes have, a learner kept on one node
that one node cannot hold) and what the learner would refuse at start (its ZeRO-3 states alone above one
GPU's memory) fail here, naming the values to change.

The learner's figure is the fixed part of its own start-up estimate (services/learner/memory.py,
model_state_bytes, broadcast_buffer_bytes, CUDA_CONTEXT, HEADROOM), for P = modelSize.parameters, else the count
in run.model's name (Qwen2.5-7B: 7B; names round down or to the nearest size, so about a lower bound, where the
pods' host memory takes the name + 10%):

  ZeRO-3 partitions     ⌈P / learner.ranks⌉ × 18 bytes (bf16 weights, fp32 master, AdamW's 2 fp32 moments,
                        fp32 gradients; 16 with learner.precision = "fp32")
                        with LoRA (learner.lora.rank > 0): ⌈P / learner.ranks⌉ × 2 bytes, the frozen base's
                        weights alone (4 with fp32); the adapters' weights, master, moments and gradients come
                        on top in the learner's estimate, but their count depends on the architecture (hidden
                        and MLP sizes, layers), which the chart does not know: left out, as if none
  gathered weights      (300M + 50M) × 2 bytes: the live and prefetched parameters (at least; a weight larger
                        than 300M elements raises it)
  reduce bucket         50M × 4 bytes × 2 (with LoRA: of the adapters' gradients, fewer than 50M for most
                        models: left out with them)
  broadcast buffers     2 × weightBroker.group.bucketMiB, with the collective transport (with LoRA only for
                        publish = merged: adapter versions go through the broker)
  CUDA context          1GiB
  usable                90% of gpuNodes.gpuMemoryGB

A step's activations come on top (and with LoRA the adapters' states), so a learner that passes here can
still be refused at start; the learner's whole estimate runs for every shipped values file in
tests/test_shipped_fit.py.

The samplers' GPUs, with weightBroker.transport collective over NCCL (a GPU learner; the sizing's
receivedOnGpus): each GPU worker of a sampler receives every version whole (W, the whole model, not its
tensor-parallel share) into buffers on its own GPU, and the engine loads it from there
(services/weight_transport/receiver.py). vLLM's engine takes sampler.gpu_memory_utilization of the GPU (as the
run file has it), so what it leaves must hold the version and what else the receive puts there:

  (1 - gpu_memory_utilization) × gpuNodes.gpuMemoryGB × 10^9  >=  W + 2GiB (the CUDA context, NCCL's
                                                                  buffers, the layer vLLM's reload
                                                                  materializes)

with W as the pods' host memory counts it (vcpo-rl.sizing.billions × modelSize.dtypeBytes). The error names
the highest utilization that passes, rounded down to 2 decimals, unless that leaves the engine less than its
own share of the weights (W / tensor parallel): then only transport tcp, whose versions come through the
broker into the pod's host memory, is left.
*/}}
{{- define "vcpo-rl.hardware.receiveHeadroomGi" -}}2{{- end -}}
{{- define "vcpo-rl.checkHardware" -}}
{{- $v := .Values -}}
{{- $n := $v.gpuNodes -}}
{{- $perNode := int $n.gpusPerNode -}}
{{- $samplerPod := int $v.sampler.gpusPerReplica -}}
{{- $learnerPod := mul (int $v.learner.ranksPerPod) (int $v.learner.gpusPerRank) -}}
{{- $learner := mul (int $v.learner.ranks) (int $v.learner.gpusPerRank) -}}
{{- $evaluator := ternary $samplerPod 0 (eq (include "vcpo-rl.dedicatedEvaluator" .) "true") -}}
{{- $total := add (mul (int $v.sampler.replicas) $samplerPod) $learner $evaluator -}}
{{- if gt $perNode 0 -}}
{{- if gt $samplerPod $perNode -}}
{{- fail (printf "sampler.gpusPerReplica = %d is more than gpuNodes.gpusPerNode = %d: a sampler pod runs on one node; lower sampler.gpusPerReplica, or set gpuNodes.gpusPerNode to the nodes' GPUs" $samplerPod $perNode) -}}
{{- end -}}
{{- if gt $learnerPod $perNode -}}
{{- fail (printf "a learner pod asks for learner.ranksPerPod × learner.gpusPerRank = %d GPUs, more than gpuNodes.gpusPerNode = %d: a pod runs on one node; lower learner.ranksPerPod" $learnerPod $perNode) -}}
{{- end -}}
{{- if and (gt $learner $perNode) (not $v.learner.spreadAcrossNodes) -}}
{{- fail (printf "the learner's learner.ranks × learner.gpusPerRank = %d GPUs do not fit one node of gpuNodes.gpusPerNode = %d, where the chart keeps a learner (its ZeRO-3 gathers every weight for each micro-batch); lower learner.ranks, or set learner.spreadAcrossNodes = true to run it over several nodes' link" $learner $perNode) -}}
{{- end -}}
{{- if and (gt (int $n.count) 0) (gt $total (mul (int $n.count) $perNode)) -}}
{{- fail (printf "the pods ask for %d GPUs (sampler.replicas %d × sampler.gpusPerReplica %d + learner.ranks %d × learner.gpusPerRank %d%s), more than the gpuNodes.count %d × gpuNodes.gpusPerNode %d = %d the release is sized for: the pods that do not fit would pend and the run never start; lower those values, or raise gpuNodes.count if the cluster has more nodes" $total (int $v.sampler.replicas) $samplerPod (int $v.learner.ranks) (int $v.learner.gpusPerRank) (ternary (printf " + the evaluator's %d" $evaluator) "" (gt $evaluator 0)) (int $n.count) $perNode (mul (int $n.count) $perNode)) -}}
{{- end -}}
{{- end -}}
{{- if and (gt (float64 $n.gpuMemoryGB) 0.0) (gt (int $v.learner.gpusPerRank) 0) -}}
{{- $cfg := include "vcpo-rl.runToml" . | fromToml -}}
{{- /* the count itself: not the host-memory sizing's name + 10%, which would refuse some learners that fit */ -}}
{{- $exact := gt (float64 $v.modelSize.parameters) 0.0 -}}
{{- $params := mulf (float64 (include "vcpo-rl.sizing.billions" .)) 1000000000.0 (ternary 1.0 (divf 1.0 1.1) $exact) -}}
{{- $fp32 := eq (dig "precision" "auto" $cfg.learner) "fp32" -}}
{{- $weight := ternary 4.0 2.0 $fp32 -}}
{{- /* LoRA: the base is frozen (its partition alone); the adapters' states, of a size the chart cannot know, are left out */ -}}
{{- $lora := gt (int (dig "lora" "rank" 0 $cfg.learner)) 0 -}}
{{- $perParam := ternary $weight (ternary 16.0 18.0 $fp32) $lora -}}
{{- $partitions := mulf (ceil (divf $params (int $v.learner.ranks))) $perParam -}}
{{- $gathered := minf (mulf 350000000.0 $weight) (mulf $params $weight) -}}
{{- $reduce := ternary 0.0 (mulf (minf 50000000.0 $params) 8.0) $lora -}}
{{- $broadcast := 0.0 -}}
{{- if eq $cfg.weight_broker.transport "collective" -}}
{{- $broadcast = mulf 2.0 (minf (mulf (float64 $cfg.weight_broker.group_bucket_mb) 1048576.0) (mulf $params $weight)) -}}
{{- end -}}
{{- $fixed := addf $partitions $gathered $reduce $broadcast 1073741824.0 -}}
{{- $usable := mulf (float64 $n.gpuMemoryGB) 1000000000.0 0.9 -}}
{{- if gt $fixed $usable -}}
{{- $source := ternary "modelSize.parameters" "its name; modelSize.parameters sets the exact count" $exact -}}
{{- $frozen := ternary (printf ", the frozen base of a LoRA run (learner.lora.rank = %d), its adapters' states not counted" (int (dig "lora" "rank" 0 $cfg.learner))) "" $lora -}}
{{- fail (printf "the learner cannot fit its GPUs: run.model %q (%.3gB parameters from %s) on learner.ranks = %d takes %.1fGB per GPU in ZeRO-3 states and buffers alone (%.1fGB of partitions at %v bytes per parameter%s), before any activation, above the %.1fGB usable of one gpuNodes.gpuMemoryGB = %vGB GPU (90%%; the learner keeps 10%% free); raise learner.ranks (more ranks hold smaller partitions), or set gpuNodes.gpuMemoryGB to the GPUs' memory" $v.run.model (divf $params 1000000000.0) $source (int $v.learner.ranks) (divf $fixed 1000000000.0) (divf $partitions 1000000000.0) $perParam $frozen (divf $usable 1000000000.0) $n.gpuMemoryGB) -}}
{{- end -}}
{{- end -}}
{{- $s := include "vcpo-rl.sizing" . | fromJson -}}
{{- if and (gt (float64 $n.gpuMemoryGB) 0.0) $s.receivedOnGpus -}}
{{- $cfg := include "vcpo-rl.runToml" . | fromToml -}}
{{- $util := float64 $cfg.sampler.gpu_memory_utilization -}}
{{- $gpu := mulf (float64 $n.gpuMemoryGB) 1000000000.0 -}}
{{- $version := mulf (float64 $s.weightsGi) 1073741824.0 -}}
{{- $need := addf $version (mulf (float64 (include "vcpo-rl.hardware.receiveHeadroomGi" .)) 1073741824.0) -}}
{{- $free := mulf (subf 1.0 $util) $gpu -}}
{{- if lt $free $need -}}
{{- $extra := dict -}}
{{- with $v.extraConfig }}{{ $extra = fromToml . }}{{ end -}}
{{- $key := ternary "sampler.gpu_memory_utilization in extraConfig" "sampler.gpuMemoryUtilization" (hasKey (dig "sampler" (dict) $extra) "gpu_memory_utilization") -}}
{{- $tp := int $v.sampler.gpusPerReplica -}}
{{- $most := maxf 0.0 (divf (floor (mulf (subf 1.0 (divf $need $gpu)) 100.0)) 100.0) -}}
{{- $share := divf $version $tp -}}
{{- $tcp := "set weightBroker.transport = tcp (versions then come through the weight broker into the sampler pod's host memory)" -}}
{{- $way := printf "lower %s to at most %.2f, or %s" $key $most $tcp -}}
{{- if gt $need $gpu -}}
{{- $way = printf "no %s makes room, as the version alone is more than one GPU holds; %s" $key $tcp -}}
{{- else if le (mulf $most $gpu) $share -}}
{{- $way = printf "no %s makes room: at most %.2f of each GPU, %.1fGB, would be left to the engine, not more than its own share of the weights (%.1fGB at tensor parallel %d); %s" $key $most (divf (mulf $most $gpu) 1000000000.0) (divf $share 1000000000.0) $tp $tcp -}}
{{- end -}}
{{- $source := ternary "modelSize.parameters" "its name + 10%; modelSize.parameters sets the exact count" (gt (float64 $v.modelSize.parameters) 0.0) -}}
{{- fail (printf "the samplers' GPUs have no room for a version: with weightBroker.transport = collective over NCCL (a GPU learner) each GPU worker of a sampler receives every version whole into its own GPU, beside vLLM's engine: %.1fGB for run.model %q (%.3gB parameters from %s, × %v bytes) + %sGiB (the CUDA context, NCCL's buffers, the layer vLLM's reload materializes) = %.1fGB, above the %.1fGB that %s = %v leaves of one gpuNodes.gpuMemoryGB = %vGB GPU; %s" (divf $version 1000000000.0) $v.run.model (float64 (include "vcpo-rl.sizing.billions" .)) $source $v.modelSize.dtypeBytes (include "vcpo-rl.hardware.receiveHeadroomGi" .) (divf $need 1000000000.0) (divf $free 1000000000.0) $key $util $n.gpuMemoryGB $way) -}}
{{- end -}}
{{- end -}}
{{- end -}}
