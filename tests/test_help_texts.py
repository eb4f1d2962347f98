"""What `--help` says matches what the commands do: `convert` names every
family it converts, `generate --prompt` points to --prompt-ids for token ids."""

import pytest

from ptdp.cli import build_parser


@pytest.fixture
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # one line per entry: no word is wrapped apart


def test_ptdp_help_names_every_family_convert_converts(wide):
    from ptdp.interop.hf_directory import HF_FAMILIES as ARCHITECTURES

    line = next(line for line in build_parser().format_help().splitlines()
                if line.strip().startswith("convert "))
    assert len(ARCHITECTURES) == 12  # GPT-2, 4 dense, 3 MoE, Gemma 3, gpt-oss, GLM-4.5, DeepSeek-V3
    for family in ARCHITECTURES:
        assert family in line, (family, line)


def test_generate_prompt_help_is_text_and_points_to_prompt_ids(wide, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    prompt = next(line for line in capsys.readouterr().out.splitlines()
                  if line.strip().startswith("--prompt TEXT"))
    assert "text to continue" in prompt and "use --prompt-ids" in prompt
