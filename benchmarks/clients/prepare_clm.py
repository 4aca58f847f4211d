"""Inputs for transformers' ``run_clm_no_trainer.py`` with no download: text, a tokenizer, a tiny GPT-2 config.

Writes into ``OUT``: ``train.txt`` and ``validation.txt`` (the docstrings of this Python's standard
library, one file in 20 held out), ``tokenizer/`` (a byte-level BPE of ``--vocab`` entries trained on
``train.txt``, saved as a ``GPT2TokenizerFast``) and ``config/`` (GPT-2 with 2 layers, width 64,
dropout 0 so that two runs on the same data draw the same numbers). Deterministic for one Python.

    python benchmarks/clients/prepare_clm.py runs/clm
"""

from __future__ import annotations

import argparse
import ast
import sysconfig
from pathlib import Path


def docstrings(limit_chars: int) -> list[str]:
    """Module, class and function docstrings of the standard library, in sorted file order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "test" in path.parts[-2:][0] or path.name.startswith("test"):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    out.append(doc.strip())
                    total += len(doc)
        if total >= limit_chars:
            break
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--chars", type=int, default=2_000_000, help="docstring characters to collect")
    p.add_argument("--vocab", type=int, default=512)
    args = p.parse_args()

    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2Config, GPT2TokenizerFast

    args.out.mkdir(parents=True, exist_ok=True)
    docs = docstrings(args.chars)
    train = [d for i, d in enumerate(docs) if i % 20]
    valid = [d for i, d in enumerate(docs) if i % 20 == 0]
    (args.out / "train.txt").write_text("\n".join(train) + "\n", encoding="utf-8")
    (args.out / "validation.txt").write_text("\n".join(valid) + "\n", encoding="utf-8")

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(train, vocab_size=args.vocab, min_frequency=2, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    tok = GPT2TokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                            unk_token="<|endoftext|>", model_max_length=1024)
    tok.save_pretrained(args.out / "tokenizer")
    config = GPT2Config(vocab_size=len(tok), n_positions=128, n_embd=64, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    config.save_pretrained(args.out / "config")
    print(f"{args.out}: {sum(map(len, train))} train / {sum(map(len, valid))} validation characters, "
          f"vocab {len(tok)}")


if __name__ == "__main__":
    main()
