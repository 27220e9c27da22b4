"""Images as the chat API takes them (the VLM tests' offline chat and server tests)."""

import base64
import io

from PIL import Image


def png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")  # lossless: the engine decodes the very pixels
    return buf.getvalue()


def data_url(img: Image.Image) -> str:
    """A data: URL of the image as PNG."""
    return "data:image/png;base64," + base64.b64encode(png(img)).decode()
