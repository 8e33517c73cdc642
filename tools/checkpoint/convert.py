r"""Convert between Hugging Face Llama / Mistral / Qwen2 safetensors and this trainer's checkpoints.

    python tools/checkpoint/convert.py --loader hf --saver megatron --load-dir llama-hf/ \
        --save-dir ckpt/ --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2
    python tools/checkpoint/convert.py --loader megatron --saver hf --load-dir ckpt-out/ --save-dir out-hf/

See megatron/training/convert/ for the layouts; --help for every flag.
"""
import sys

from megatron.training.convert.convert import main

if __name__ == "__main__":
    sys.exit(main())
