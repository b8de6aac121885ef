"""The render-wave bench (loadtest/bench/chat_render_wave.py) runs the gateway's real ChatRenderer:
each helper count renders every conversation of the wave, to the ids the template gives directly."""
from __future__ import annotations

import re


def test_a_small_wave_renders_every_turn_for_each_helper_count(capsys):
    from loadtest.bench.chat_render_wave import conversations, main
    from loadtest.multiturn.synthetic_dialogs import SyntheticShape
    from services.gateway.openai_api.prompt_builder import PromptBuilder
    from shared.model_files.default_model import resolve_model_dir

    assert main(["--conversations", "4", "--system-len", "120", "--turns", "2", "--processes", "1,2",
                 "--waves", "1"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (\d+) \| (\d+) \| (\d+) \| (\d+) \|$", out, re.MULTILINE)
    assert [r[0] for r in rows] == ["1", "2"], out
    tokens = int(re.search(r"(\d+) prompt tokens each", out).group(1))
    builder = PromptBuilder.from_model_dir(resolve_model_dir(None, progress=False))
    direct = builder.chat_prompt_ids(conversations(builder.tokenizer, SyntheticShape(4, 120, 2))[0])
    # the wave's first conversation, rendered by a helper, as rendered here: 120 + 64 + 48 + 64
    # synthetic tokens (exact lengths) and the template's own
    assert tokens == len(direct) > 120 + 64 + 48 + 64
