"""The texts people read: the model card (MODEL.md) and the pull-request review body."""

from __future__ import annotations

from typing import Any

METRICS = [
    ("video_top1", "video top-1"),
    ("video_top5", "video top-5"),
    ("clip_top1", "clip top-1"),
    ("clip_top5", "clip top-5"),
    ("loss", "loss"),
]


def model_card(r: dict[str, Any]) -> str:
    """MODEL.md: a summary table, metrics, data, how to load it, lineage."""
    arch = r["architecture"]
    fp = r.get("data_fingerprint") or {}
    lines = [
        f"# {r['name']} v{r['version']}",
        "",
        _what(r),
        "",
        "| | |",
        "| --- | --- |",
        f"| model | `{arch['model']}` {_options(arch)} |",
        f"| input | {arch['input']['frames']} frames of {arch.get('crop') or arch['input']['height']} px, uint8 RGB |",
        f"| classes | {', '.join(r['classes'])} |",
        f"| weights | `model.safetensors`, {r['files']['model.safetensors']['size'] / 2**20:.1f} MiB, sha256 "
        f"`{r['files']['model.safetensors']['sha256'][:16]}...` |",
        f"| parent | {r.get('parent') or 'none'} |",
        f"| code | {r.get('code_commit') or 'unknown'} |",
        f"| Slurm job | {r.get('slurm_job_id') or 'not run under Slurm'} |",
        "",
        f"## Metrics ({r.get('metrics_split') or 'evaluation'} split)",
        "",
        "| metric | value |",
        "| --- | ---: |",
        *[f"| {label} | {r['metrics'][key]:.4f} |" for key, label in METRICS if key in r["metrics"]],
        "",
    ]
    per_class = r.get("per_class_accuracy") or {}
    if per_class:
        lines += [
            "Per-class accuracy (video level): "
            + ", ".join(f"{c} {v:.2f}" if v is not None else f"{c} n/a" for c, v in per_class.items()),
            "",
        ]
    lines += _federation(r.get("federated"))
    lines += [
        "## Data",
        "",
        f"Clip store format {fp.get('format_version', '?')}, index sha256 "
        f"`{str(fp.get('index_sha256', '?'))[:16]}...`; "
        f"clips of {fp.get('params', {}).get('clip_frames', '?')} frames at "
        f"{fp.get('params', {}).get('height', '?')}x{fp.get('params', {}).get('width', '?')}.",
        "",
        "## How to load it",
        "",
        "```bash",
        f"clipforge registry pull {r['name']}@v{r['version']} --to ./{r['name']}",
        "```",
        "",
        "```python",
        "from clipforge.models.builders import create_model, load_weights",
        f"model = create_model({arch['model']!r}, {len(r['classes'])}, {arch['input']['frames']}, "
        f"{arch.get('crop') or arch['input']['height']}{_kwargs(arch)})",
        f"load_weights(model, './{r['name']}/model.safetensors')",
        "```",
        "",
    ]
    return "\n".join(lines)


def _what(r: dict[str, Any]) -> str:
    """The card's first sentence: a classifier trained here, one imported, or an encoder from pretraining."""
    model, imported, pretraining = r["architecture"]["model"], r.get("imported"), r.get("pretraining")
    if pretraining:
        return (
            f"A {model} encoder pretrained as a masked autoencoder (mask ratio {pretraining['mask_ratio']}) with "
            "clipforge, without a classifier: fine-tune it with `train.py --model.weights`."
        )
    if imported:
        what = "encoder, without a classifier," if imported.get("encoder_only") else "video classifier"
        if not imported.get("encoder_only"):
            what += f" for {len(r['classes'])} classes,"
        return f"A {model} {what} imported from a {imported['from']} checkpoint (sha256 `{imported['sha256'][:16]}`)."
    return f"A {model} video classifier for {len(r['classes'])} classes, trained with clipforge."


def _federation(fed: dict[str, Any] | None) -> list[str]:
    """How a federated model trained, and the privacy it promises (epsilon at delta), for the card."""
    if not fed:
        return []
    lines = [
        "## Federated training",
        "",
        f"{fed.get('strategy', 'FedAvg')} on {fed.get('engine', 'flower')}: {fed['rounds']} rounds over "
        f"{fed['clients']} clients ({fed.get('client_fraction', 1.0):g} of them a round), updates aggregated "
        f"{fed.get('aggregation', 'in the clear')}.",
        "",
    ]
    dp, sample = fed.get("differential_privacy"), fed.get("sample_differential_privacy")
    if dp:
        lines += [
            f"Client-level differential privacy: ({dp['epsilon']:.3g}, {dp['delta']:g})-DP, from noise multiplier "
            f"{dp['noise_multiplier']:g} on updates clipped to L2 norm {dp['clipping_norm']:g} "
            f"({dp.get('accountant', 'RDP accountant')}).",
            "",
        ]
    if sample:
        eps = sample["epsilon"]
        spent = "epsilon not reported" if eps is None else f"({eps:.3g}, {sample['delta']:g})-DP"
        lines += [
            f"Sample-level differential privacy (DP-SGD on every client): {spent} for each clip, from noise "
            f"multiplier {sample['noise_multiplier']:g} on per-clip gradients clipped to L2 norm "
            f"{sample['clipping_norm']:g} ({sample.get('accountant', 'RDP accountant')}).",
            "",
        ]
    if not dp and not sample:
        lines += ["No differential privacy: the weights carry no formal privacy guarantee.", ""]
    return lines


def review_text(
    new: dict[str, Any], base: dict[str, Any] | None, against: str | None, weights: dict[str, Any] | None = None
) -> str:
    """The pull-request body: what changed against the alias, metric deltas with arrows, weights, then the card."""
    title = f"{new['name']} v{new['version']}"
    lines = [f"## Review: {title}", ""]
    if base is None:
        lines += [f"First version of `{new['name']}`: nothing to compare with.", ""]
    else:
        label = (
            f"{against} (v{base['version']})"
            if against and base["version"] != _parent_version(new)
            else f"v{base['version']}"
        )
        lines += [f"Compared with {label}.", ""]
        warning = different_data(base, new)
        if warning:
            lines += [f"**Warning:** {warning}", ""]
        lines += [
            "| metric | before | after | change |",
            "| --- | ---: | ---: | :---: |",
        ]
        for key, name in METRICS:
            if key in new["metrics"] and key in base["metrics"]:
                before, after = base["metrics"][key], new["metrics"][key]
                better = after < before if key == "loss" else after > before
                arrow = "=" if abs(after - before) < 1e-9 else ("▲ better" if better else "▼ worse")
                lines.append(f"| {name} | {before:.4f} | {after:.4f} | {after - before:+.4f} {arrow} |")
        lines.append("")
        changes = list(config_changes(base.get("training_config", {}), new.get("training_config", {})))
        if changes:
            lines += ["Training config changes:", ""] + [f"- `{k}`: {a!r} → {b!r}" for k, a, b in changes[:30]] + [""]
        if weights is not None:
            lines += weight_lines(weights, base["version"])
        size_a, size_b = base["files"]["model.safetensors"]["size"], new["files"]["model.safetensors"]["size"]
        if size_a != size_b:
            lines += [f"Weights: {size_a / 2**20:.1f} MiB → {size_b / 2**20:.1f} MiB.", ""]
    lines += ["---", "", model_card(new)]
    return "\n".join(lines)


def different_data(base: dict[str, Any], new: dict[str, Any]) -> str | None:
    """One line when two versions' metrics come from different data (another store, split or clip parameters)."""
    a, b = base.get("data_fingerprint") or {}, new.get("data_fingerprint") or {}
    what = [
        label
        for label, x, y in (
            ("clip store", a.get("index_sha256"), b.get("index_sha256")),
            ("clip parameters", a.get("params"), b.get("params")),
            ("classes", a.get("classes"), b.get("classes")),
            ("evaluation split", base.get("metrics_split"), new.get("metrics_split")),
        )
        if x != y
    ]
    if not what:
        return None
    store = lambda r: (r.get("data_fingerprint") or {}).get("index_sha256", "?")[:12]  # noqa: E731
    return (
        f"the metrics come from different data ({', '.join(what)} differ: v{base['version']} on store "
        f"{store(base)}, v{new['version']} on {store(new)}), so their deltas say little; evaluate both on one store"
    )


def weight_diff(a: Any, b: Any) -> dict[str, Any]:
    """Per tensor of two safetensors files: relative L2 norm of the change, and what was added or removed."""
    import numpy as np
    from safetensors import safe_open

    with safe_open(str(a), framework="np") as fa, safe_open(str(b), framework="np") as fb:
        keys_a, keys_b = set(fa.keys()), set(fb.keys())
        changed, reshaped, same = [], [], 0
        for key in sorted(keys_a & keys_b):
            x, y = fa.get_tensor(key), fb.get_tensor(key)
            if x.shape != y.shape:
                reshaped.append((key, list(x.shape), list(y.shape)))
                continue
            x64, y64 = x.astype(np.float64), y.astype(np.float64)
            delta = float(np.linalg.norm(y64 - x64))
            if delta == 0.0:
                same += 1
                continue
            norm = float(np.linalg.norm(x64))
            changed.append((key, delta / norm if norm else float("inf"), int(x.size)))
    changed.sort(key=lambda c: -c[1])
    return {
        "changed": changed,
        "reshaped": reshaped,
        "unchanged": same,
        "added": sorted(keys_b - keys_a),
        "removed": sorted(keys_a - keys_b),
    }


def weight_lines(w: dict[str, Any], base_version: int, top: int = 15) -> list[str]:
    lines = [
        f"Weights against v{base_version}: {len(w['changed'])} tensors changed, {w['unchanged']} unchanged, "
        f"{len(w['added'])} added, {len(w['removed'])} removed, {len(w['reshaped'])} reshaped.",
        "",
    ]
    if w["changed"]:
        lines += ["| tensor | elements | relative change ‖Δ‖/‖before‖ |", "| --- | ---: | ---: |"]
        lines += [f"| `{k}` | {n:,} | {r:.4g} |" for k, r, n in w["changed"][:top]]
        if len(w["changed"]) > top:
            lines.append(f"| ... {len(w['changed']) - top} more | | |")
        lines.append("")
    for label, keys in (("Added", w["added"]), ("Removed", w["removed"])):
        if keys:
            lines += [f"{label}: " + ", ".join(f"`{k}`" for k in keys[:20]), ""]
    for key, x, y in w["reshaped"][:20]:
        lines += [f"Reshaped: `{key}` {x} → {y}", ""]
    return lines


def _parent_version(r: dict[str, Any]) -> int | None:
    parent = r.get("parent")
    return int(parent.rsplit("@v", 1)[1]) if parent else None


def config_changes(a: Any, b: Any, prefix: str = ""):
    """(dotted key, before, after) for every setting that differs between two nested configs."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            yield from config_changes(a.get(key), b.get(key), f"{prefix}{key}.")
    elif a != b:
        yield prefix.rstrip("."), a, b


def _options(arch: dict[str, Any]) -> str:
    extra = {k: v for k, v in arch.items() if k not in ("model", "input", "crop")}
    return "(" + ", ".join(f"{k}={v}" for k, v in extra.items()) + ")" if extra else ""


def _kwargs(arch: dict[str, Any]) -> str:
    extra = {
        k: (tuple(v) if isinstance(v, list) else v) for k, v in arch.items() if k not in ("model", "input", "crop")
    }
    return "".join(f", {k}={v!r}" for k, v in extra.items())
