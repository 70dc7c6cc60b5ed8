"""Image input: decoding what a user sends (image_input), and each family's image processor, which turns
a picture into what its vision tower reads (qwen_processor, gemma_processor; chosen in processors)."""

from tinymlx.vision.gemma_processor import Gemma3ImageProcessor, Gemma4ImageProcessor, gemma4_position_ids
from tinymlx.vision.image_input import ImageError, ImageLimits, decode_image, to_rgb
from tinymlx.vision.processors import ImageProcessor, image_processor_for
from tinymlx.vision.qwen_processor import QwenImageProcessor, smart_resize

__all__ = [
    "Gemma3ImageProcessor",
    "Gemma4ImageProcessor",
    "ImageError",
    "ImageLimits",
    "ImageProcessor",
    "QwenImageProcessor",
    "decode_image",
    "gemma4_position_ids",
    "image_processor_for",
    "smart_resize",
    "to_rgb",
]
