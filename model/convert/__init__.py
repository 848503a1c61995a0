"""Convert pretrained ViTs from timm, torchvision and Hugging Face into checkpoints of this project.

    python -m model.convert timm --arch vit_small_patch16_224 --weights FILE --output OUT.safetensors
    python -m model.convert torchvision --arch vit_b_16 --weights FILE --output OUT.safetensors
    python -m model.convert hf --model-dir DIR --output OUT.safetensors

Each source module builds the library's own model, checks that it uses only what `model.vit.ViT`
implements (refusing anything else by name), maps its weights, and reads its evaluation transform
into a `Preprocessing`. Before anything is written, the converted model's logits are compared with
the library model's on the same input. The libraries are needed here only: the output is an
ordinary checkpoint that the service loads without them.
"""
