# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The memory report's rows for the flex dispatcher's communication buffers: their bytes and
what ``reset_fused_a2a_buffers()`` returns, and the memory planner's prediction
(``scripts/moe_memory_plan.py``) beside what the run measured."""

from typing import Any, Dict, List, Optional


def comm_buffer_lines(b: Optional[Dict[str, Any]], p: Optional[Dict[str, Any]]) -> List[str]:
    """Rows for the flex dispatcher's communication buffers and what releasing them returns."""
    if not b or not p:
        return []

    def cell(d: Dict[str, Any], key: str) -> str:
        v = d.get(key)
        return "n/a" if v is None else f"{v:,}"

    rows = [
        ("comm buffers (emulated bytes)", "emulated_bytes"),
        ("  returned by reset_fused_a2a_buffers", "allocator_bytes_released"),
    ]
    if p.get("device_bytes_released") is not None:
        rows.append(("  device memory outside allocator", "device_bytes_released"))
    return [f"{label:34}{cell(b, key):>16}{cell(p, key):>16}{'':>14}" for label, key in rows]


def hybridep_prediction(cfg: Dict[str, Any], world: int) -> Optional[Dict[str, Any]]:
    """The memory planner's prediction for the report's configuration (flex/HybridEP only):
    buffer bytes and one call's outputs, with balanced routing."""
    if cfg.get("dispatcher", "flex") != "flex" or cfg["backend"] != "hybridep":
        return None
    import moe_memory_plan

    planner = moe_memory_plan.load_planner()
    mc = planner.MoEMemoryConfig(
        hidden_size=cfg["hidden"], num_moe_experts=cfg["experts"], moe_router_topk=cfg["topk"],
        num_layers=cfg.get("layers", 1), expert_model_parallel_size=world,
        tokens_per_rank=cfg["tokens"], moe_token_dispatcher_type="flex",
        moe_flex_dispatcher_backend="hybridep", bf16=False,
    )  # fmt: skip
    # The report's model runs in fp32: 4-byte tokens where HybridEP moves 16-bit ones.
    calls = planner.per_call_bytes(mc, token_bytes=4)
    buffer = planner.total(planner.buffer_terms(mc), planner.OUTSIDE)
    return {"buffer_bytes": buffer, "per_call": calls}


def hybridep_accounting_lines(
    cfg: Dict[str, Any], patched: Dict[str, Any], world: int
) -> List[str]:
    """Predicted (balanced routing) beside measured: the buffer and one call's outputs."""
    pred = hybridep_prediction(cfg, world)
    measured = patched.get("per_call_bytes") or {}
    buffers = patched.get("comm_buffers") or {}
    if pred is None:
        return []
    lines = [f"{'HybridEP accounting':34}{'predicted':>16}{'measured':>16}{'meas/pred':>14}"]
    rows = [("  buffer", pred["buffer_bytes"], buffers.get("emulated_bytes"))]
    if buffers.get("device_bytes_released") is not None:
        rows.append(("  buffer (device, outside alloc.)", pred["buffer_bytes"],
                     buffers["device_bytes_released"]))  # fmt: skip
    for key in ("dispatch_tokens", "dispatch_probs", "combine_output"):
        rows.append((f"  {key} (max call)", pred["per_call"][key], measured.get(key)))
    for label, x, y in rows:
        y_text = "n/a" if y is None else f"{y:,}"
        r = f"{y / x:.3f}" if y is not None and x else ""
        lines.append(f"{label:34}{x:>16,}{y_text:>16}{r:>14}")
    return lines
