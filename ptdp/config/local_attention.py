"""Local attention settings of the model section, with Megatron-LM's flags,
names and meanings: sliding windows (`--window-size L,R`, per layer by
`--window-attn-skip-freq`) and attention sinks (`--softmax-type`), and
their checks. ModelConfig inherits the fields, so they are model settings
on the command line and in --config files.

A window (L, R) lets query i see keys i - L .. i + R; ptdp's models are
causal, so R is 0, and L = -1 is no bound (Megatron-LM's "infinite").
Hugging Face's `sliding_window` W (the W most recent keys, the query's own
included) is (W - 1, 0). `--window-attn-skip-freq N` makes every N-th layer
(counting from 1) a full one, or a pattern of 0 (full) and 1 (windowed)
gives each layer's kind (megatron/core/transformer/utils.py
is_layer_window_attention). `--softmax-type off-by-one` adds a zero logit
to each softmax's denominator; `learnable` a trained one per head (gpt-oss's
sinks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ptdp.config.base import flag, is_count
from ptdp.config.moe import _shown_pattern, parse_layer_pattern

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


@dataclass
class LocalAttentionFields:
    # "str | list[int]": the command line reads "L,R"; a --config file may give
    # the text or a list of two ints.
    window_size: str | list[int] | None = flag(
        None, "--window-size",
        "sliding-window attention: L,R lets each query see the L keys before it and R after "
        "(causal models: R = 0; L = -1 is unbounded); the layers --window-attn-skip-freq leaves "
        "windowed use it, the others attend to the whole sequence", metavar="L,R")
    window_attn_skip_freq: str | int | list[int] | None = flag(
        None, "--window-attn-skip-freq",
        "with --window-size: which layers attend to the whole sequence: an int N makes every N-th "
        "layer (counting from 1) full and the others windowed; or Megatron-LM's pattern of 1 "
        "(windowed) and 0 (full), one per layer, such as \"([1]*5+[0])*4\" (default: every layer "
        "windowed)", metavar="N|PATTERN")
    softmax_type: str = flag(
        "vanilla", "--softmax-type",
        "the attention softmax: vanilla; off-by-one (a zero logit added to each denominator); "
        "learnable (a trained logit per head, gpt-oss's attention sinks)",
        choices=SOFTMAX_TYPES)

    def __post_init__(self) -> None:
        window = self.window_size
        if isinstance(window, (list, tuple)):
            self.window_size = ",".join(map(str, window))
        freq = self.window_attn_skip_freq
        if isinstance(freq, str) and freq.strip().isdigit():
            self.window_attn_skip_freq = int(freq)
        elif isinstance(freq, (list, tuple)) and all(is_count(x, 0) for x in freq):
            self.window_attn_skip_freq = "[" + ",".join(map(str, freq)) + "]"

    @property
    def window(self) -> tuple[int, int] | None:
        """--window-size as (L, R); None without one. ValueError for text
        that is not two integers (local_attention_problems says so)."""
        if self.window_size is None:
            return None
        parts = str(self.window_size).strip().strip("()").split(",")
        if len(parts) != 2:
            raise ValueError(f"--window-size {self.window_size}: give two integers L,R")
        return int(parts[0]), int(parts[1])

    @property
    def windowed_layers(self) -> list[bool]:
        """For each layer (0-based), whether it attends through the window."""
        layers = self.num_layers  # type: ignore[attr-defined]  # ModelConfig's
        if not is_count(layers, 0):  # (a bad --num-layers: reported by its own check)
            return []
        if self.window is None or self.window[0] == -1:  # (-1: unbounded, no window)
            return [False] * layers
        freq = self.window_attn_skip_freq
        if freq is None:
            return [True] * layers
        if is_count(freq, 1):
            return [(i + 1) % freq != 0 for i in range(layers)]
        pattern = parse_layer_pattern(str(freq), "--window-attn-skip-freq",
                                      "every N-th layer attends to the whole sequence",
                                      ("full", "windowed"))
        if len(pattern) != layers:
            raise ValueError(f"--window-attn-skip-freq {_shown_pattern(str(freq))} gives "
                             f"{len(pattern)} layers, but --num-layers is {layers}: give one 0/1 "
                             f"per layer")
        return [bool(x) for x in pattern]

    def layer_window(self, layer: int) -> tuple[int, int] | None:
        """Layer `layer`'s (0-based) window, None where it attends to the whole sequence."""
        return self.window if self.windowed_layers[layer] else None

    @property
    def has_sinks(self) -> bool:
        return self.softmax_type != "vanilla"

    @property
    def local_attention(self) -> bool:
        """Whether some layer attends through a window or with sinks."""
        return self.has_sinks or any(self.windowed_layers)


def local_attention_problems(m: Any) -> list[str]:
    """The local-attention settings' problems, one paragraph each (`m`: a
    ModelConfig)."""
    problems = []
    if m.window_size is not None:
        try:
            left, right = m.window
        except ValueError:
            return [f"--window-size {m.window_size}: give two integers L,R, the keys each query "
                    f"sees before and after it, such as 4095,0 (Hugging Face's sliding_window "
                    f"4096)"]
        if right != 0:
            problems.append(f"--window-size {m.window_size}: ptdp's models are causal, so a query "
                            f"sees no key after it: give R = 0 ({left},0)")
        if left < -1:
            problems.append(f"--window-size {m.window_size}: L is the keys each query sees before "
                            f"it, 0 or more (-1: no bound)")
    freq = m.window_attn_skip_freq
    if freq is not None and m.window_size is None:
        problems.append(f"--window-attn-skip-freq {freq} chooses which layers are windowed: give "
                        f"--window-size too, or drop it")
    elif freq is not None:
        if isinstance(freq, bool) or (isinstance(freq, int) and freq < 1):
            problems.append(f"--window-attn-skip-freq {freq}: give a positive integer N (every "
                            f"N-th layer full) or a pattern of 0/1 per layer")
        else:
            try:
                m.windowed_layers
            except ValueError as error:
                problems.append(str(error))
    if (m.has_sinks or m.window_size is not None) and m.attention_dropout > 0:
        problems.append(f"--attention-dropout {m.attention_dropout:g} with sliding windows or "
                        f"attention sinks: ptdp's windowed attention has no dropout (gpt-oss and "
                        f"Gemma 3 train without it): give --attention-dropout 0")
    return problems
