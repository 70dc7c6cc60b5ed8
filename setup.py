"""The packages are found, not listed: tinymlx's, one per stage, and the chat UI, whose folder ui/
installs as `tinymlx_ui` (never as a global `ui` module; pyproject.toml maps the folder)."""

from setuptools import find_packages, setup

ui_packages = ["tinymlx_ui" + name.removeprefix("ui") for name in find_packages(include=["ui", "ui.*"])]
setup(packages=[*find_packages(include=["tinymlx", "tinymlx.*"]), *ui_packages])
