"""`python -m pipeline.inspect` (bin/buffer-inspect): look into a buffer directory or a live buffer.

  summary TARGET                 rows, groups, versions, staleness histogram, reward by version, ...
  samples TARGET [--tokenizer DIR] [--limit N] [--uid U]   samples as text (or token ids)
  export  TARGET OUT.parquet     every stored row, with its state (live / served / evicted)
  plot    TARGET OUT.png         staleness and reward by version

TARGET is a buffer directory (read-only: torn tails are reported, not repaired) or a live server
address (tcp://...; shows the live rows, which inspection does not consume).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="buffer-inspect", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, text in [
        ("summary", "overview tables"),
        ("samples", "show samples"),
        ("export", "to Parquet"),
        ("plot", "PNG of staleness and reward by version"),
    ]:
        s = sub.add_parser(name, help=text)
        s.add_argument("target", help="buffer directory or tcp:// address of a live buffer")
        s.add_argument(
            "--version", type=int, default=None, help="trainer version for staleness (default: latest known)"
        )
        s.add_argument(
            "--timeout-s", type=float, default=10.0, help="how long a live buffer has to answer (default 10)"
        )
        if name == "samples":
            s.add_argument(
                "--tokenizer",
                default="",
                help="decode token ids to text: an HF model folder, or a built-in model name (tiny-qwen2)",
            )
            s.add_argument("--limit", type=int, default=5)
            s.add_argument("--uid", default="", help="only this uid")
            s.add_argument("--state", default="", choices=["", "live", "served", "evicted"])
        if name == "summary":
            s.add_argument("--json", action="store_true", help="one JSON object instead of tables")
        if name in ("export", "plot"):
            s.add_argument("out", help="output file")
    return p.parse_args(argv)


def load(target: str, timeout_s: float = 10.0):
    """(pyarrow Table with a `state` column, info dict) for a directory or a live address (which has
    `timeout_s` to answer each request)."""
    import pyarrow as pa

    from buffer.record import ARROW_SCHEMA

    if "://" in target:
        from buffer.client import BufferClient

        c = BufferClient(target, timeout_s=timeout_s)
        try:
            stats = c.stats()
            batch = c.peek(max(1, stats["rows"]))
        finally:
            c.close()
        table = pa.Table.from_batches([batch] if batch is not None else [], schema=ARROW_SCHEMA)
        table = table.append_column("state", pa.array(["live"] * table.num_rows))
        return table, {"version": stats["version"], "stats": stats, "torn": []}
    return _load_dir(target)


def _load_dir(target: str):
    from pathlib import Path

    import pyarrow as pa

    from buffer.record import ARROW_SCHEMA
    from buffer.segments import SEGMENT_GLOB, iter_log, read_segment

    d = Path(target)
    if not d.is_dir():
        sys.exit(f"{target} is neither a buffer directory nor a tcp:// address")
    batches, torn = [], []
    for path in sorted(d.glob(SEGMENT_GLOB)):
        got, rep = read_segment(path)
        batches += got
        if rep.problem:
            torn.append(vars(rep))
    table = pa.Table.from_batches(batches, schema=ARROW_SCHEMA)
    state: dict[str, str] = {}
    served_at: dict[str, int] = {}  # the trainer version when the row was served: its real staleness
    version = 0
    for r in iter_log(d):
        version = max(version, r.v)
        for u in r.uids:
            state[u] = "served" if r.op == "served" else "evicted"
            if r.op == "served":
                served_at.setdefault(u, r.v)
    uids = table.column("uid").to_pylist()
    table = table.append_column("state", pa.array([state.get(u, "live") for u in uids], pa.string()))
    table = table.append_column("served_at", pa.array([served_at.get(u, -1) for u in uids], pa.int64()))
    return table, {"version": version, "stats": None, "torn": torn, "dir": str(d)}


def summarise(table, info, version: int | None) -> dict:
    """The summary's figures: counts, staleness of live rows now and of served rows when they were
    trained (from the consumption log), and reward by oldest token version in at most 10 bins."""
    import numpy as np
    import pyarrow.compute as pc

    v = info["version"] if version is None else version
    minv = table.column("min_version").to_numpy()
    reward = table.column("reward").to_numpy()
    state = np.array(table.column("state").to_pylist(), dtype=object)
    statuses = {
        str(k): int(n) for k, n in zip(*np.unique(table.column("status").to_pylist(), return_counts=True))
    }
    out = {
        "version": int(v),
        "rows": table.num_rows,
        "live": int((state == "live").sum()),
        "served": int((state == "served").sum()),
        "evicted": int((state == "evicted").sum()),
        "groups": len(pc.unique(table.column("group_id"))),
        "status": statuses,
        "torn": info["torn"],
    }
    if info["stats"]:
        st = info["stats"]
        out["rejected_messages"] = st.get("rejected_messages", 0)
        out["rejects"] = st.get("rejects", {})
        out["server_evictions"] = st.get("evicted_stale", 0)

    def hist(x) -> dict:
        return {int(k): int(n) for k, n in zip(*np.unique(x, return_counts=True))}

    out["staleness_live"] = hist(v - minv[state == "live"])
    if "served_at" in table.column_names:  # a directory: the version each served row was trained at
        served = state == "served"
        trained = table.column("served_at").to_numpy()[served] - minv[served]
        out["staleness_when_trained"] = hist(trained)
        if len(trained):
            out["staleness_when_trained_mean"] = round(float(trained.mean()), 3)
    bins = []
    versions = np.unique(minv)
    for chunk in np.array_split(versions, min(10, len(versions))) if len(versions) else []:
        r = reward[(minv >= chunk[0]) & (minv <= chunk[-1])]
        bins.append(
            {
                "versions": [int(chunk[0]), int(chunk[-1])],
                "rows": len(r),
                "mean": round(float(r.mean()), 4),
                "std": round(float(r.std()), 4),
                "min": round(float(r.min()), 4),
                "max": round(float(r.max()), 4),
            }
        )
    out["reward_by_version"] = bins
    return out


def summary(table, info, version: int | None, as_json: bool = False) -> None:
    import json

    from rich.console import Console
    from rich.table import Table

    d = summarise(table, info, version)
    if as_json:
        print(json.dumps(d))
        return
    con = Console()
    head = Table(title=f"buffer at trainer version {d['version']}", show_header=False)
    head.add_row("rows (all / live)", f"{d['rows']} / {d['live']}")
    head.add_row("groups", str(d["groups"]))
    head.add_row("served (consumed)", str(d["served"]))
    head.add_row("evicted as stale", str(d["evicted"]))
    head.add_row("status counts", ", ".join(f"{k}={n}" for k, n in d["status"].items()) or "-")
    if "rejected_messages" in d:
        head.add_row("rejected messages", f"{d['rejected_messages']} {d['rejects']}")
        head.add_row("server evictions", str(d["server_evictions"]))
    for t in d["torn"]:
        head.add_row(
            f"[red]torn {t['name']}", f"{t['torn_bytes']} bytes after {t['batches']} batches: {t['problem']}"
        )
    con.print(head)
    if not d["rows"]:
        return
    for key, title in (
        ("staleness_when_trained", "staleness when trained (served at version - oldest token version)"),
        ("staleness_live", "staleness of live rows now (version - oldest token version)"),
    ):
        if d.get(key):
            t = Table(title=title)
            t.add_column("staleness", justify="right")
            t.add_column("rows", justify="right")
            for k, n in d[key].items():
                t.add_row(str(k), str(n))
            con.print(t)
    by = Table(title="reward by oldest token version")
    for c in ("versions", "rows", "mean", "std", "min", "max"):
        by.add_column(c, justify="right")
    # at most ~10 rows, however long the run: did the reward rise is the question, not each version
    for b in d["reward_by_version"]:
        lo, hi = b["versions"]
        span = str(lo) if lo == hi else f"{lo}-{hi}"
        by.add_row(span, str(b["rows"]), *(f"{b[k]:.3f}" for k in ("mean", "std", "min", "max")))
    con.print(by)


def samples(table, args) -> None:
    import pyarrow.compute as pc
    from rich.console import Console
    from rich.panel import Panel

    from buffer.record import batch_to_samples

    con = Console()
    if args.uid:
        table = table.filter(pc.equal(table.column("uid"), args.uid))
    if args.state:
        table = table.filter(pc.equal(table.column("state"), args.state))
    table = table.slice(0, args.limit)
    tok = None
    if args.tokenizer:
        from stages.models import ModelConfig, ModelError, load_tokenizer, resolve_model

        try:  # a folder, or a built-in name such as tiny-qwen2 (built and cached on first use)
            folder = Path(args.tokenizer).expanduser()
            tok = load_tokenizer(
                folder if folder.is_dir() else resolve_model(ModelConfig(name=args.tokenizer))
            )
        except (ModelError, OSError) as e:
            raise SystemExit(f"buffer-inspect: --tokenizer {args.tokenizer}: {e}") from None
    states = table.column("state").to_pylist()
    for s, state in zip(batch_to_samples(table.drop_columns(["state"])), states):
        p, r = s.array("prompt_ids").tolist(), s.array("response_ids").tolist()
        body = f"[b]prompt[/b] {tok.decode(p) if tok else p}\n[b]response[/b] {tok.decode(r) if tok else r}"
        title = (
            f"{s.uid}  group {s.group_id}[{s.group_index}/{s.group_size}]  reward {s.reward:.3f}  "
            f"{s.status}  versions {s.min_version()}..{int(s.array('versions').max()) if s.response_len else -1}"
            f"  {state}"
        )
        con.print(Panel(body, title=title, title_align="left"))


def plot(table, info, out: str, version: int | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from pipeline.series import draw_steps

    v = info["version"] if version is None else version
    minv = table.column("min_version").to_numpy()
    reward = table.column("reward").to_numpy()
    steps = _run_metrics(info.get("dir"))
    if steps:  # the run's metrics.jsonl beside the buffer: the trainer's side too
        fig, axes = plt.subplots(2, 2, figsize=(10, 7))
        (a, b), (c, d) = axes
        draw_steps(
            c, steps, [("tis/weight_mean", "mean weight"), ("tis/clip_frac", "share clipped")], "TIS weight"
        )
        draw_steps(
            d,
            steps,
            [("logp/abs_diff_train_rollout", "all tokens"), ("logp/abs_diff_same_version", "same weights")],
            "logprob gap, engine vs trainer",
        )
        for ax in (c, d):
            ax.set_xlabel("trainer step")
    else:
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    served = table.column("served_at").to_numpy() if "served_at" in table.column_names else None
    if served is not None and (served >= 0).any():  # the staleness each row had when it was trained
        st = (served - minv)[(served >= 0) & (minv >= 0)]
        a.hist(st, bins=np.arange(st.min(), st.max() + 2) - 0.5)
        a.set(title="staleness when trained", xlabel="serving version - oldest token version", ylabel="rows")
    else:  # a live server: no consumption log here, only the distance to the current version
        a.hist(v - minv, bins=max(1, len(np.unique(minv))))
        a.set(title=f"staleness at version {v}", xlabel="version - oldest token version", ylabel="rows")
    vers = np.unique(minv)
    bins = np.array_split(vers, min(50, len(vers))) if len(vers) else []  # <= 50 points, however long the run
    centre = [c.mean() for c in bins]
    means = np.array([reward[(minv >= c[0]) & (minv <= c[-1])].mean() for c in bins])
    stds = np.array([reward[(minv >= c[0]) & (minv <= c[-1])].std() for c in bins])
    b.plot(centre, means, marker=".")
    b.fill_between(centre, means - stds, means + stds, alpha=0.2)
    b.set(title="reward by version (mean, +-1 std)", xlabel="oldest token version", ylabel="reward")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def _run_metrics(buffer_dir: str | None) -> list[dict]:
    """The steps of the run whose buffer this is (`<run dir>/buffer` beside `<run dir>/metrics.jsonl`),
    or [] when there is no such file."""
    import json
    from pathlib import Path

    if not buffer_dir:
        return []
    path = Path(buffer_dir).resolve().parent / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line torn by a kill
            continue
        if "step" in row and "reward/mean" in row:
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from buffer.client import BufferUnavailable
    from buffer.wire import ProtocolError

    try:
        table, info = load(args.target, args.timeout_s)
    except (BufferUnavailable, ProtocolError, FileNotFoundError, NotADirectoryError) as e:
        # one line, no traceback: an unreachable buffer or a wrong folder is the user's to fix
        print(f"buffer-inspect: {args.target}: {e}", file=sys.stderr)
        return 1
    if args.cmd == "summary":
        summary(table, info, args.version, as_json=args.json)
    elif args.cmd == "samples":
        samples(table, args)
    elif args.cmd == "export":
        import pyarrow.parquet as pq

        pq.write_table(table, args.out)
        print(f"wrote {table.num_rows} rows to {args.out}")
    elif args.cmd == "plot":
        plot(table, info, args.out, args.version)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
