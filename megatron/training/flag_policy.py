"""What the command line does with the Megatron flags it does not implement as such: refused with
a reason (UNSUPPORTED, OUT_OF_SCOPE), accepted as changing nothing (NO_OP), or read only under a
switch (NEEDS_SWITCH). No imports: --help and bad command lines answer before torch is loaded."""

# Megatron flags this trainer does not implement (yet), with the reason the user sees.
UNSUPPORTED = {
    "--use-legacy-models": "only megatron-core models are supported",
    "--tp-comm-overlap": "TP communication overlap needs Transformer Engine userbuffers, not implemented here",
    "--tp-comm-overlap-cfg": "TP communication overlap needs Transformer Engine userbuffers, not implemented here",
    "--overlap-param-gather-with-optimizer-step": "the all-gather is overlapped with the next forward "
                                                  "(--overlap-param-gather), not with the optimizer step",
    "--apply-wd-to-qk-layernorm": "weight decay is never applied to norm weights (1-D parameters)",
    "--squared-relu": "the squared-ReLU activation is not implemented",
    "--step-batch-size-schedule": "batch-size ramp-up is not implemented",
    "--eval-global-batch-size": "evaluation uses the training global batch size",
    "--save-retain-interval": "checkpoint retention is not implemented: every save is kept",
    "--wgrad-deferral-limit": "weight-gradient deferral is not implemented",
    "--defer-embedding-wgrad-compute": "weight-gradient deferral is not implemented",
    "--no-rope-freq": "layers without RoPE (NoPE) are not implemented (every layer rotates)",
    "--empty-unused-memory-level": "emptying the CUDA cache between steps is not implemented",
    "--grad-reduce-in-bf16": "gradients are reduced in fp32 (the gradient buffer is fp32)",
    "--main-grads-dtype": "main gradients are fp32",
    "--use-precision-aware-optimizer": "the optimizer keeps fp32 main parameters and fp32 moments",
    "--ddp-num-buckets": "buckets are sized by --ddp-bucket-size",
    "--check-for-large-grads": "only NaN / Inf gradients are checked (--check-for-nan-in-loss-and-grad)",
    "--lr-wsd-decay-style": "the WSD learning-rate schedule is not implemented",
    "--lr-wsd-decay-iters": "the WSD learning-rate schedule is not implemented",
    "--lr-wsd-decay-samples": "the WSD learning-rate schedule is not implemented",
    "--rampup-batch-size": "batch-size ramp-up is not implemented: every iteration takes --global-batch-size",
    "--optimizer-cpu-offload": "optimizer CPU offload is not implemented (MEMO offloads activations: --memo)",
    "--full-validation": "validation reads --eval-iters batches (a pass over the whole set is not implemented)",
    "--multiple-validation-sets": "one validation set (the --split share of --data-path) is read",
    "--log-straggler": "straggler detection is not implemented (--timing-log-level 1 prints each timer's "
                       "min and max over the ranks)",
    "--result-rejected-tracker-filename": "rejected results are printed to the log ('rerun:' lines), not kept in a "
                                          "tracker file",
    "--iterations-to-skip": "skipping chosen iterations is not implemented",
    "--log-progress": "progress.txt (tokens and FLOPs so far) is not written: the iteration line has both rates",
    "--log-energy": "energy is not measured",
    "--log-device-memory-used": "the driver's device memory figure is not logged (the memory line has the "
                                "allocator's, --log-memory-to-tensorboard writes them)",
    "--log-max-attention-logit": "the largest attention logit is not logged (the kernels never hold the scores)",
    "--nvtx-ranges": "NVTX ranges per op come with --profile (without --use-pytorch-profiler), not per module",
}

# Settings read only under their switch: given without it, they would change nothing.
_LLAMA3 = ("--use-rope-scaling", lambda a: a.use_rope_scaling)
_YARN = ("--rope-type yarn", lambda a: a.rope_type == "yarn")
_PROFILE = ("--profile", lambda a: a.profile)
_TORCH_PROFILER = ("--profile --use-pytorch-profiler", lambda a: a.profile and a.use_pytorch_profiler)
NEEDS_SWITCH = {"--use-pytorch-profiler": _PROFILE, "--profile-step-start": _PROFILE, "--profile-step-end": _PROFILE,
                "--profile-ranks": _PROFILE, "--pytorch-profiler-collect-shapes": _TORCH_PROFILER,
                "--pytorch-profiler-collect-callstack": _TORCH_PROFILER,
                "--memory-snapshot-path": ("--record-memory-history", lambda a: a.record_memory_history),
"--rope-scaling-factor": _LLAMA3, "--rotary-scaling-factor": _YARN, "--beta-fast": _YARN,
                "--beta-slow": _YARN, "--mscale": _YARN, "--mscale-all-dim": _YARN,
                "--original-max-position-embeddings": ("--use-rope-scaling or --rope-type yarn",
                                                       lambda a: a.use_rope_scaling or a.rope_type == "yarn"),
                **{f"--memo-{name}": ("--memo", lambda a: a.memo)
                   for name in ("swap-fraction", "planner", "plan", "save-plan", "host-memory-gb")}}

# megatron-core's StrictHandling values (spelled out: importing megatron.core costs seconds, and
# --help and bad command lines answer before it is imported; a test keeps the two equal).
STRICTNESS = ["assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
              "return_unexpected", "return_all", "ignore_all"]

# Flag families outside this project's scope (a GPT trainer for long sequences), by name or
# prefix (ending in "-"), with the reason the user sees.
_MOE = "mixture-of-experts models are outside this project's scope"
_MLA = "multi-latent attention is outside this project's scope"
_FSDP = "FSDP is not implemented (use --use-distributed-optimizer)"
OUT_OF_SCOPE = {
    "--num-experts": _MOE, "--moe-": _MOE, "--expert-": _MOE,
    "--linear-": "linear attention (hybrid models) is outside this project's scope",
    "--experimental-attention-variant": "attention variants other than softmax attention are outside this "
                                        "project's scope",
    "--attention-output-gate": "gated attention is outside this project's scope",
    "--dsa-indexer-": "sparse-attention indexers are outside this project's scope",
    "--multi-latent-attention": _MLA, "--q-lora-rank": _MLA, "--kv-lora-rank": _MLA, "--qk-head-dim": _MLA,
    "--qk-pos-emb-head-dim": _MLA, "--v-head-dim": _MLA,
    "--fp8-": "FP8 training is not implemented", "--fp8-format": "FP8 training is not implemented",
    "--use-torch-fsdp2": _FSDP, "--use-megatron-fsdp": _FSDP, "--megatron-fsdp-": _FSDP,
    "--data-parallel-sharding-strategy": _FSDP,
    "--wandb-": "Weights & Biases logging is not implemented (use --tensorboard-dir)",
    "--fim-": "fill-in-the-middle data is not implemented",
    "--use-mup": "muP is not implemented", "--mup-": "muP is not implemented",
    "--export-": "model export is not implemented",
}

# Flags a Megatron launch script passes that change nothing here, with the reason (shown by --help).
NO_OP = {
    "--use-mcore-models": "megatron-core models are the only ones",
    "--no-rope-fusion": "RoPE is ours (core attention, from position ids), never megatron-core's fused one",
    "--no-persist-layer-norm": "the norms are ours, not apex's persistent LayerNorm",
    "--no-async-tensor-model-parallel-allreduce": "megatron-core 0.16 has no such switch",
    "--accumulate-allreduce-grads-in-fp32": "always on: gradients are accumulated and reduced in fp32 "
                                            "under --bf16 and --fp16",
    "--use-cpu-initialization": "always on: identical weights for every tp size",
    "--attention-softmax-in-fp32": "always: every kernel keeps the softmax in fp32",
    "--disable-gloo-process-groups": "no gloo groups are made beside the NCCL ones (on CPU gloo is the backend "
                                     "itself)",
    "--use-persistent-ckpt-worker": "each --async-save writes from a freshly forked process; a persistent "
                                    "worker only saves that fork",
    "--async-ckpt-use-cpu-shm": "the writer process inherits the host copies of the tensors by fork; no "
                                "shared-memory staging is needed",
    "--dist-ckpt-optim-fully-reshardable": "the optimizer is always saved per model parameter, reshardable "
                                           "in every dimension",
    "--apply-query-key-layer-scaling": "it divides the scores by the layer number and multiplies them back "
                                       "inside the softmax, which changes nothing mathematically; it keeps "
                                       "fp16 scores in range, and every kernel here scales them in fp32",
    "--overlap-p2p-communication-warmup-flush": "pipeline sends never block and each receive is posted ahead, "
                                                "in every phase of every schedule (warm-up and flush included)",
    "--no-barrier-with-L1-time": "the timers never wait at a barrier before timing: what the flag asks is "
                                 "always so",
}
