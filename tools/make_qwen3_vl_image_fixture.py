#!/usr/bin/env python3
"""tools/make_qwen3_vl_image_fixture.py: the image fixtures of tests/data/test_images.cpp.

Writes into tests/data/fixtures/images/ (or --out):

  rgb.png, rgba.png, la.png, gray.png, gray_trns.png, palette.png   PNGs saved by PIL
  photo.jpg, progressive.jpg, gray.jpg, cmyk.jpg                     JPEGs saved by PIL
  decoded.safetensors    u8 [H, W, 3] per file: what transformers' convert_to_rgb
                         makes of PIL.Image.open(file) ("over_white.<file>"), and
                         PIL's convert("RGB") ("ignore_alpha.<file>") for files with
                         transparency; cmyk.jpg is absent (slime refuses CMYK)
  preprocessor_config.json   the processor options of the golden check (Qwen3-VL's
                         patch 16 / merge 2 / temporal 2 / mean = std = 0.5, with
                         pixel bounds small enough for a small fixture)
  qwen3_vl_2b_preprocessor_config.json   Qwen/Qwen3-VL-2B-Instruct's config values
  qwen3_vl_golden.safetensors
    pixel_values    f32 [rows, 1536]  transformers' Qwen2VLImageProcessor (the
                                      torchvision backend, AutoImageProcessor's
                                      default when torchvision is installed) on
                                      GOLDEN_FILES in one call
    image_grid_thw  i64 [3, 3]
  qwen3_vl_golden.json   versions, the files, smart_resize cases computed by
                         transformers' own smart_resize (Qwen3-VL defaults and the
                         fixture's bounds), and the measured difference between
                         transformers' torchvision and PIL backends

Run (PyPI packages):
  python3 -m venv /tmp/venv-vl
  /tmp/venv-vl/bin/pip install transformers pillow numpy safetensors torch torchvision
  /tmp/venv-vl/bin/python tools/make_qwen3_vl_image_fixture.py
The whole fixture stays under 400 KB; the script checks.
"""
import argparse
import json
import math
import pathlib

import numpy as np
import PIL
from PIL import Image
from safetensors.numpy import save_file

import torch
import torchvision
import transformers
from transformers.image_transforms import convert_to_rgb
from transformers.models.qwen2_vl import image_processing_qwen2_vl as tv_mod
from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil_mod

# Qwen/Qwen3-VL-2B-Instruct's preprocessor_config.json.
QWEN3_VL_2B = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
# The golden check's options: Qwen3-VL's, with pixel bounds that keep the
# fixture small (the default min of 2^16 pixels would make 256 rows an image).
FIXTURE_CONFIG = dict(QWEN3_VL_2B, size={"longest_edge": 6144, "shortest_edge": 1024})
# rgba.png 13x21 upsamples to 32x64 (and composites alpha), photo.jpg 150x110
# downsamples to 64x64, palette.png 40x90 goes to 32x96 (shrinks rows, grows
# columns).
GOLDEN_FILES = ["rgba.png", "photo.jpg", "palette.png"]
MAX_FIXTURE_BYTES = 400_000


def picture(h, w, seed):
    """A smooth gradient with a few discs and noise: content a resize can get wrong."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    img = np.stack([255 * x / max(w - 1, 1), 255 * y / max(h - 1, 1), 128 + 100 * np.sin((x + y) / 5.0)], -1)
    for _ in range(4):
        cy, cx, r = rng.uniform(0, h), rng.uniform(0, w), rng.uniform(2, max(3, min(h, w) / 3))
        img[(y - cy) ** 2 + (x - cx) ** 2 < r * r] = rng.uniform(0, 255, 3)
    img += rng.normal(0, 12, img.shape)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def write_images(out):
    Image.fromarray(picture(13, 21, 1)).save(out / "rgb.png")
    rgba = np.dstack([picture(13, 21, 2), np.random.default_rng(3).integers(0, 256, (13, 21), dtype=np.uint8)])
    rgba[0, :4, 3] = [0, 255, 1, 128]
    Image.fromarray(rgba, "RGBA").save(out / "rgba.png")
    gray = picture(9, 7, 4)[..., 0]
    Image.fromarray(gray, "L").save(out / "gray.png")
    la = np.dstack([gray, np.random.default_rng(5).integers(0, 256, (9, 7), dtype=np.uint8)])
    Image.fromarray(la, "LA").save(out / "la.png")
    trns = gray.copy()
    trns[2:5, 2:5] = 77
    Image.fromarray(trns, "L").save(out / "gray_trns.png", transparency=77)
    pal = Image.fromarray(picture(40, 90, 6)).quantize(colors=16, method=Image.Quantize.MEDIANCUT)
    pal.save(out / "palette.png", transparency=0)
    Image.fromarray(picture(150, 110, 7)).save(out / "photo.jpg", quality=90)
    Image.fromarray(picture(17, 33, 8)).save(out / "progressive.jpg", quality=85, progressive=True)
    Image.fromarray(gray, "L").save(out / "gray.jpg", quality=90)
    Image.fromarray(np.random.default_rng(9).integers(0, 256, (8, 8, 4), dtype=np.uint8), "CMYK").save(
        out / "cmyk.jpg", quality=90)


def decoded(out):
    tensors = {}
    for f in ["rgb.png", "rgba.png", "la.png", "gray.png", "gray_trns.png", "palette.png", "photo.jpg",
              "progressive.jpg", "gray.jpg"]:
        im = Image.open(out / f)
        tensors["over_white." + f] = np.ascontiguousarray(convert_to_rgb(im, return_numpy=True))
        if "A" in im.getbands() or im.info.get("transparency") is not None:
            tensors["ignore_alpha." + f] = np.ascontiguousarray(np.array(im.convert("RGB")))
    return tensors


def processors(config):
    kwargs = {k: v for k, v in config.items() if k not in ("processor_class", "image_processor_type")}
    return tv_mod.Qwen2VLImageProcessor(**kwargs), pil_mod.Qwen2VLImageProcessorPil(**kwargs)


def smart_resize_cases():
    sizes = [(1, 1), (13, 21), (31, 33), (32, 32), (48, 48), (80, 16), (16, 80), (100, 1), (1, 200), (1, 201),
             (224, 224), (255, 256), (256, 256), (300, 200), (480, 640), (720, 1280), (1080, 1920), (1001, 333),
             (2000, 10), (250, 4000), (4096, 4096), (4100, 4100), (5000, 7000), (12000, 9000), (40000, 200)]
    bounds = [(32, 65536, 16777216), (32, 1024, 6144), (28, 56 * 56, 28 * 28 * 1280)]
    cases = []
    for factor, lo, hi in bounds:
        for h, w in sizes:
            try:
                rh, rw = tv_mod.smart_resize(h, w, factor=factor, min_pixels=lo, max_pixels=hi)
                cases.append([h, w, factor, lo, hi, int(rh), int(rw)])
            except ValueError:
                cases.append([h, w, factor, lo, hi, -1, -1])  # refused (aspect ratio > 200)
    return cases


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent.parent / "tests/data/fixtures/images"))
    out = pathlib.Path(ap.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)

    write_images(out)
    save_file(decoded(out), str(out / "decoded.safetensors"))
    for name, cfg in [("preprocessor_config.json", FIXTURE_CONFIG),
                      ("qwen3_vl_2b_preprocessor_config.json", QWEN3_VL_2B)]:
        (out / name).write_text(json.dumps(cfg, indent=2) + "\n")

    # AutoImageProcessor's choice for this model without a backend argument.
    from transformers.models.auto import image_processing_auto as auto
    backend = auto._resolve_backend(None, None, "Qwen2VLImageProcessor")
    assert backend == "torchvision", backend

    tv, pil = processors(FIXTURE_CONFIG)
    images = [Image.open(out / f) for f in GOLDEN_FILES]
    got = tv(images=images, return_tensors="np")
    ref = pil(images=images, return_tensors="np")
    pv = np.ascontiguousarray(got["pixel_values"], dtype=np.float32)
    grid = np.ascontiguousarray(got["image_grid_thw"], dtype=np.int64)
    assert (grid == ref["image_grid_thw"]).all()
    diff = np.abs(pv - ref["pixel_values"].astype(np.float32))
    save_file({"pixel_values": pv, "image_grid_thw": grid}, str(out / "qwen3_vl_golden.safetensors"))

    meta = {
        "generator": "tools/make_qwen3_vl_image_fixture.py",
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                     "torchvision": torchvision.__version__, "pillow": PIL.__version__, "numpy": np.__version__},
        "processor": "transformers.models.qwen2_vl.image_processing_qwen2_vl.Qwen2VLImageProcessor (torchvision)",
        "auto_backend": backend,
        "golden_files": GOLDEN_FILES,
        "image_grid_thw": grid.tolist(),
        "torchvision_vs_pil_backend": {
            "max_abs": float(diff.max()),
            "fraction_differing": float((diff > 0).mean()),
            "note": "transformers' PIL backend (Qwen2VLImageProcessorPil) against the torchvision one on the same "
                    "images; one uint8 level is 2/255 = 0.00784 after normalisation",
        },
        "smart_resize_cases": {
            "columns": ["height", "width", "factor", "min_pixels", "max_pixels", "out_height", "out_width"],
            "note": "out -1 -1: transformers raises (aspect ratio above 200)",
            "cases": smart_resize_cases(),
        },
    }
    (out / "qwen3_vl_golden.json").write_text(json.dumps(meta, indent=1) + "\n")

    total = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {out} ({total} bytes); rows {pv.shape[0]}, grids {grid.tolist()}; "
          f"torchvision vs PIL backend max abs {diff.max():.6f}, {100 * (diff > 0).mean():.2f}% differ")
    assert total <= MAX_FIXTURE_BYTES, f"fixture is {total} bytes, over {MAX_FIXTURE_BYTES}"


if __name__ == "__main__":
    main()
