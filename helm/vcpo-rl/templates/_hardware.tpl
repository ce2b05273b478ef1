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
  gathered weights      (300M + 50M) × 2 bytes: the live and prefetched parameters (at least; a weight larger
                        than 300M elements raises it)
  reduce bucket         50M × 4 bytes × 2
  broadcast buffers     2 × weightBroker.group.bucketMiB, with the collective transport
  CUDA context          1GiB
  usable                90% of gpuNodes.gpuMemoryGB

A step's activations come on top, so a learner that passes here can still be refused at start; the learner's
whole estimate runs for every shipped values file in tests/test_shipped_fit.py.
*/}}
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
{{- $partitions := mulf (ceil (divf $params (int $v.learner.ranks))) (ternary 16.0 18.0 $fp32) -}}
{{- $gathered := minf (mulf 350000000.0 $weight) (mulf $params $weight) -}}
{{- $reduce := mulf (minf 50000000.0 $params) 8.0 -}}
{{- $broadcast := 0.0 -}}
{{- if eq $cfg.weight_broker.transport "collective" -}}
{{- $broadcast = mulf 2.0 (minf (mulf (float64 $cfg.weight_broker.group_bucket_mb) 1048576.0) (mulf $params $weight)) -}}
{{- end -}}
{{- $fixed := addf $partitions $gathered $reduce $broadcast 1073741824.0 -}}
{{- $usable := mulf (float64 $n.gpuMemoryGB) 1000000000.0 0.9 -}}
{{- if gt $fixed $usable -}}
{{- $source := ternary "modelSize.parameters" "its name; modelSize.parameters sets the exact count" $exact -}}
{{- fail (printf "the learner cannot fit its GPUs: run.model %q (%.3gB parameters from %s) on learner.ranks = %d takes %.1fGB per GPU in ZeRO-3 states and buffers alone (%.1fGB of partitions at %s bytes per parameter), before any activation, above the %.1fGB usable of one gpuNodes.gpuMemoryGB = %vGB GPU (90%%; the learner keeps 10%% free); raise learner.ranks (more ranks hold smaller partitions), or set gpuNodes.gpuMemoryGB to the GPUs' memory" $v.run.model (divf $params 1000000000.0) $source (int $v.learner.ranks) (divf $fixed 1000000000.0) (divf $partitions 1000000000.0) (ternary "16" "18" $fp32) (divf $usable 1000000000.0) $n.gpuMemoryGB) -}}
{{- end -}}
{{- end -}}
{{- end -}}
