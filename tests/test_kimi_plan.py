"""scripts/kimi_plan.py: the numbers of docs/design.md's Kimi K2.6 table against hand arithmetic."""

from __future__ import annotations

import json

from scripts.kimi_plan import CONFIG, plan, table


def test_the_kimi_k26_plan_matches_hand_arithmetic():
    numbers = plan(json.loads(CONFIG.read_text()))
    assert numbers["kv_per_token"] == 61 * (512 + 64) * 2  # every layer's latent, bf16: 70,272 bytes
    assert numbers["draft_kv_per_token"] == 6 * 2 * 8 * 128 * 2  # 6 GQA layers, 8 KV heads of 128
    assert numbers["all_reduce_per_round"] == 2 * 61 * 16 * 17 * 7168 * 2  # 2 a layer, bf16 hidden states
    # 60 MoE layers, 384 / 8 experts a rank, 3 matrices of 7168 x 2048, 4 bits + a bf16 scale per 32
    assert numbers["stored"]["int4"] == 60 * 48 * 3 * 7168 * 2048 * (0.5 + 2 / 32)
    per_request = -(-(32768 + 16) // 16) * 16 * (70272 + 24576)
    assert numbers["requests_stored"] == int(numbers["pool_stored"] // per_request)
    assert numbers["requests_dequantized"] == 0  # bf16 experts leave no room at 0.9 of 288 GB
    assert "| 32k-token requests it holds | 54 | 0 |" in table(numbers)
