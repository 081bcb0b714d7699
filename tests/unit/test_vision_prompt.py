"""The pieces of a prompt with images, alone: message parts for the template, the prefix
cache's content key, and which checkpoints are served with images."""

from __future__ import annotations

import pytest

from replicas.contract import ChatMessage, ImageAt, ImageData
from replicas.pipeline.prompt import template_message
from replicas.vision import VisionUnsupported, _content_key, sees

RED = ImageData(b"red pixels", "image/png")
BLUE = ImageData(b"blue pixels", "image/png")
IMG, END = 7, 9


def test_images_become_parts_where_they_stand() -> None:
    message = ChatMessage("user", "Look at this and that.", images=(
        ImageAt(0, RED), ImageAt(12, BLUE), ImageAt(12, RED), ImageAt(22, BLUE)))
    assert template_message(message)["content"] == [
        {"type": "image"}, {"type": "text", "text": "Look at this"}, {"type": "image"},
        {"type": "image"}, {"type": "text", "text": " and that."}, {"type": "image"}]
    assert template_message(ChatMessage("user", "plain"))["content"] == "plain"


def test_the_content_key_follows_each_image() -> None:
    ids = [1, 2, IMG, IMG, 3, IMG, END, 4, IMG, IMG, END]
    red_blue = _content_key(ids, [RED, BLUE], IMG, END)
    # Text positions keep their ids; every image position gets its own negative id.
    assert [k for k, t in zip(red_blue, ids) if t != IMG] == [t for t in ids if t != IMG]
    image_keys = [k for k, t in zip(red_blue, ids) if t == IMG]
    assert all(k < 0 for k in image_keys) and len(set(image_keys)) == len(image_keys)
    assert _content_key(ids, [RED, BLUE], IMG, END) == red_blue  # deterministic
    red_red = _content_key(ids, [RED, RED], IMG, END)
    assert red_red[:7] == red_blue[:7] and red_red[7:] != red_blue[7:]  # only the 2nd differs
    assert _content_key(ids, [BLUE, BLUE], IMG, END)[:7] != red_blue[:7]


def test_which_checkpoints_see() -> None:
    for served in ("mistral3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5",
                   "qwen3_5_moe", "gemma3", "gemma4", "lfm2-vl"):
        config = {"model_type": served, "vision_config": {}}
        assert sees(config) and sees(config, "vision")
        assert not sees(config, "text")
    assert not sees({"model_type": "qwen3"})
    gemma3n = {"model_type": "gemma3n", "vision_config": {}}
    with pytest.raises(VisionUnsupported, match="model type gemma3n has a vision tower"):
        sees(gemma3n)  # never text only by surprise
    assert not sees(gemma3n, "text")
    with pytest.raises(VisionUnsupported, match="model type qwen3_omni_moe has a vision tower"):
        sees({"model_type": "qwen3_omni_moe", "vision_config": {}})  # Qwen3-VL, 3.5 only
    with pytest.raises(VisionUnsupported, match="model type glm4v has a vision tower"):
        sees({"model_type": "glm4v", "vision_config": {}})  # mlx-lm has no glm4v text half
    with pytest.raises(VisionUnsupported, match="images are served only for model types"):
        sees({"model_type": "qwen3"}, "vision")
