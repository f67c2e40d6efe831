"""DeepSpeed's ``ds_to_universal`` converter, with every ``torch.load`` it makes weights-only.

The converter reads checkpoint files with ``torch.load(weights_only=False)``. Run as
``python -m orch.launchers.engines.deepspeed.safe_convert`` with the converter's own arguments, it does the same work
with ``torch.load`` replaced (:func:`orch.launchers.safe_load.verified_loading`): files of the input
folder must match its manifest, and nothing is unpickled beyond tensors, plain data and the
DeepSpeed classes of the allow-list. Its pool workers, if any, are forked and inherit this.
"""

from __future__ import annotations

from deepspeed.checkpoint import ds_to_universal

from orch.launchers.engines.deepspeed.checkpoint_files import ds_verified_loading


def main() -> None:
    args = ds_to_universal.parse_arguments()
    with ds_verified_loading(args.input_folder, strict=False):
        ds_to_universal.main(args)


if __name__ == "__main__":
    main()
