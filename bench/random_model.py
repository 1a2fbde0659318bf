"""A random-weight HF model folder of a real Qwen2.5 shape, or of the Qwen3-MoE shape `moe-small`
(16 experts, top-4, ~2B parameters), that the whole pipeline can run (SGLang serves it, megatron
trains it), for speed and memory work at sizes no pretrained model here has.

    python bench/random_model.py 7b /tmp/models        # prints the folder's path
    python bench/random_model.py moe-small /tmp/models # /tmp/models/qwen3-moe-small-random

The weights come from bench/trainer_gpu.py's build_model (bf16 safetensors, built on the GPU). The
tokenizer files are SmolLM2-135M's (the only tokenizer on the machine): its 49k ids all fall inside
Qwen's 152k vocabulary, so prompts encode and every sampled id decodes or is skipped.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.trainer_gpu import SHAPES, build_model  # noqa: E402
from pipeline.config import ModelConfig  # noqa: E402
from stages.models import resolve_model  # noqa: E402
from stages.trainer.export import TOKENIZER_FILES  # noqa: E402


def main() -> None:
    shape, root = sys.argv[1], sys.argv[2]
    if shape not in SHAPES:
        raise SystemExit(f"unknown shape {shape!r}; one of {', '.join(SHAPES)}")
    path = Path(build_model(shape, root))
    tok = resolve_model(ModelConfig(name="smollm2-135m", cache_dir=root))
    for name in TOKENIZER_FILES:
        if (tok / name).exists():
            shutil.copy(tok / name, path / name)
    print(path)


if __name__ == "__main__":
    main()
