"""``conceptdict hookpoints --model M``: every hookpoint of a model with its activation shape, as a table."""

import conceptdict as cd

HELP = "list every hookpoint of a text or image model with its shape and the width d of a stored row"


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="default",
                        help="hub name or local directory of the model (\"default\": the bundled all-MiniLM-L6-v2)")
    parser.add_argument("--device", default="cpu", help="device for the probe forward")
    parser.add_argument("--dtype", default="float32", help="dtype the model runs in (float32, float16, bfloat16)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer for a text model saved without one")


def run(args) -> int:
    options = {"dtype": args.dtype} | ({"tokenizer": args.tokenizer} if args.tokenizer else {})
    print(cd.hookpoints(args.model, device=args.device, **options).format())
    return 0
