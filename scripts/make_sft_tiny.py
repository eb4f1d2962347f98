"""Regenerate ptdp/data/assets/sft-tiny/, the data of examples/sft-tiny.yaml.

    python scripts/make_sft_tiny.py [--out DIR]

The directory is a Hugging Face tokenizer directory and a chat set:
* tokenizer.json: the shipped Shakespeare BPE (shakespeare-bpe-2048.json)
  with <|im_start|> and <|im_end|> added as special tokens (ids 2048, 2049);
* tokenizer_config.json: <|im_end|> the end of a turn (eos_token), and
  <|endoftext|> the padding, as transformers reads them;
* chat_template.jinja: ptdp's ChatML template (assets/chatml.jinja), whose
  {% generation %} markers put each assistant reply and its <|im_end|> in
  the loss;
* chat.jsonl: synthetic conversations ({"messages": [...]}, no system
  turn), one to four exchanges each, of a few templated kinds with varied
  wording: sums, the larger of two numbers, a word backwards, a word's
  letters, greetings. Every answer has a fixed shape that echoes the
  question ("7 plus 5 is 12.", "14 is larger than 9."), which a model of a
  million parameters picks up in a few hundred iterations.

Everything is seeded: running the script again writes the same bytes
(tests/test_sft_tiny_example.py checks the shipped files against it).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "ptdp" / "data" / "assets"
BASE_TOKENIZER = ASSETS / "shakespeare-bpe-2048.json"
CHATML_TEMPLATE = ASSETS / "chatml.jinja"
DEFAULT_OUT = ASSETS / "sft-tiny"
CHAT_TURN_TOKENS = ["<|im_start|>", "<|im_end|>"]
SEED = 40
CONVERSATIONS = 2000
# How many exchanges (user question, assistant answer) a conversation has:
# mostly one, some up to four, so that conversation lengths spread from
# about 20 to 150 tokens and packing several into a sequence matters.
EXCHANGES = (1, 2, 3, 4)
EXCHANGE_WEIGHTS = (50, 25, 15, 10)

WORDS = """cat dog horse mouse bird fish cow sheep goat lion tiger bear wolf fox deer frog
duck owl hen bee ant crab seal whale snake rabbit apple pear plum lemon grape melon bread
cheese milk honey salt sugar rice bean corn tea red blue green yellow black white brown pink
gold silver house door window table chair bed lamp clock book pen paper cup plate spoon knife
river lake sea hill tree leaf flower grass stone sand rain snow wind cloud star moon sun storm
king queen knight castle sword crown ship boat road bridge town city garden forest winter
summer spring autumn morning evening night friend mother father sister brother""".split()

PLUS_QUESTIONS = ["What is {a} plus {b}?", "What's {a} plus {b}?", "How much is {a} plus {b}?",
                  "Add {a} and {b}.", "Please add {a} and {b}.", "What do you get if you add {a} and {b}?",
                  "Compute {a} plus {b}."]
LARGER_QUESTIONS = ["Which is larger, {a} or {b}?", "Which number is bigger: {a} or {b}?",
                    "Is {a} or {b} larger?", "Which is greater, {a} or {b}?",
                    "Tell me the larger of {a} and {b}."]
BACKWARDS_QUESTIONS = ["Spell {w} backwards.", "How is {w} spelled backwards?",
                       "Reverse the word {w}.", "Can you spell {w} backwards?",
                       "Write {w} backwards."]
LETTERS_QUESTIONS = ["How many letters are in {w}?", "How many letters does {w} have?",
                     "Count the letters in {w}.", "How long is the word {w}?"]
GREETINGS = ["Hello!", "Hi.", "Hi there!", "Good morning.", "Hello, who are you?", "Hey!"]
GREETING_ANSWER = "Hello! Ask me to add two numbers, compare them, or spell a word backwards."


def _plus(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    return rng.choice(PLUS_QUESTIONS).format(a=a, b=b), f"{a} plus {b} is {a + b}."


def _larger(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(range(1, 100), 2)
    return (rng.choice(LARGER_QUESTIONS).format(a=a, b=b),
            f"{max(a, b)} is larger than {min(a, b)}.")


def _backwards(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return (rng.choice(BACKWARDS_QUESTIONS).format(w=word),
            f"The word {word} backwards is {word[::-1]}.")


def _letters(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return (rng.choice(LETTERS_QUESTIONS).format(w=word),
            f"The word {word} has {len(word)} letters.")


KINDS = (_plus, _larger, _backwards, _letters)


def conversation(rng: random.Random) -> dict:
    """One conversation: an optional greeting, then one to four questions."""
    messages = []
    if rng.random() < 0.15:
        messages += [{"role": "user", "content": rng.choice(GREETINGS)},
                     {"role": "assistant", "content": GREETING_ANSWER}]
    for _ in range(rng.choices(EXCHANGES, EXCHANGE_WEIGHTS)[0]):
        question, answer = rng.choice(KINDS)(rng)
        messages += [{"role": "user", "content": question},
                     {"role": "assistant", "content": answer}]
    return {"messages": messages}


def write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(BASE_TOKENIZER))
    tokenizer.add_special_tokens(CHAT_TURN_TOKENS)
    tokenizer.save(str(out / "tokenizer.json"), pretty=True)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
              "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "unk_token": None, "clean_up_tokenization_spaces": False,
              "model_max_length": 256}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.copyfile(CHATML_TEMPLATE, out / "chat_template.jinja")


def write_chat_set(out: Path) -> None:
    rng = random.Random(SEED)
    lines = [json.dumps(conversation(rng), separators=(",", ":")) for _ in range(CONVERSATIONS)]
    (out / "chat.jsonl").write_text("\n".join(lines) + "\n")


def make_sft_tiny(out: Path = DEFAULT_OUT) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out)
    write_chat_set(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory to write")
    print(make_sft_tiny(parser.parse_args().out))


if __name__ == "__main__":
    main()
