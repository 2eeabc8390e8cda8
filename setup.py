"""Package discovery for the wheel: everything under plugins/ is the package `specplug`.

pyproject.toml holds the metadata; this file only lists the packages, found by walking
the tree (so a new subpackage is in the wheel without editing a list), and maps the
committed test-bed heads (heads/) to the data-only package `specplug.testbed_heads`.
"""

from setuptools import find_packages, setup

PACKAGES = ["specplug"] + [f"specplug.{name}" for name in find_packages("plugins")]

setup(
    packages=PACKAGES + ["specplug.testbed_heads"],
    package_dir={"specplug": "plugins", "specplug.testbed_heads": "heads"},
)
