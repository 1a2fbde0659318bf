"""Write slipstream's prompt JSONL (bench/export_task.py's schema: {"prompt": [chat messages], "label",
"metadata"}) as the parquet files verl's RLHFDataset reads: one row per prompt with `data_source`,
`prompt` (the chat messages; verl applies the model's chat template, as slipstream does),
`ability`, `reward_model` {"style": "rule", "ground_truth": label} and `extra_info` {"split", "index"}.
verl's reward manager hands `ground_truth` to bench/peers/verl_reward.py, which scores it with
slipstream's `math` reward.

    python bench/peers/to_parquet.py bench/data/basic_arithmetic.jsonl /tmp/peer-data [--val 64]

Writes OUT/train.parquet (every row) and OUT/val.parquet (the first --val rows; verl needs a validation
file even when it never validates) and prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def verl_row(example: dict, index: int, split: str) -> dict:
    """One verl dataset row from one JSONL example; refuses an example without messages or label."""
    prompt = example.get("prompt")
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not prompt or not all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in prompt):
        raise ValueError(f"row {index}: 'prompt' must be chat messages [{{role, content}}, ...]: {prompt!r}")
    if example.get("label") is None:
        raise ValueError(f"row {index}: no 'label' (the ground truth the math reward compares with)")
    meta = example.get("metadata") or {}
    source = meta.get("rg_dataset") or meta.get("source_dataset") or "jsonl"
    return {
        "data_source": str(source),
        # only role and content: a message's other keys would make the parquet schema ragged
        "prompt": [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(example["label"])},
        "extra_info": {"split": split, "index": index},
    }


def read_jsonl(path: str | Path) -> list[dict]:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n + 1}: not JSON ({e})") from None
    return rows


def convert(src: str | Path, out_dir: str | Path, *, val: int = 64) -> dict:
    """Write train.parquet and val.parquet under out_dir; returns their paths and row counts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    examples = read_jsonl(src)
    if not examples:
        raise ValueError(f"{src}: no rows")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, part in (("train", examples), ("val", examples[: max(1, val)])):
        table = pa.Table.from_pylist([verl_row(e, i, split) for i, e in enumerate(part)])
        paths[split] = str(out / f"{split}.parquet")
        pq.write_table(table, paths[split])
    return {
        "train": paths["train"],
        "val": paths["val"],
        "rows": len(examples),
        "val_rows": min(len(examples), max(1, val)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", help="prompt JSONL (bench/export_task.py's schema)")
    ap.add_argument("out_dir")
    ap.add_argument("--val", type=int, default=64, help="rows in val.parquet (the first ones)")
    args = ap.parse_args()
    print(json.dumps(convert(args.src, args.out_dir, val=args.val)))


if __name__ == "__main__":
    main()
