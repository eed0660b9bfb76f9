"""The wheel's packages, found rather than listed, so that a new package cannot be left out.

Everything else is in pyproject.toml. Package discovery there cannot rename a folder, and the
shipped tables live in mappings/ (where users edit and add them) but install as ckpt_tools/mappings/
(pyproject's package-dir). Each table folder is a namespace package: setuptools' form for a data folder
inside a package.
"""

from setuptools import find_namespace_packages, find_packages, setup

TABLES = "ckpt_tools.mappings"

setup(
    packages=[
        *find_packages(include=["ckpt_tools", "ckpt_tools.*"]),
        TABLES,
        *(f"{TABLES}.{folder}" for folder in find_namespace_packages("mappings")),
    ],
)
