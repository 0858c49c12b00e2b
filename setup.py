"""Package discovery; the metadata lives in pyproject.toml. Every package under dgc/ is found, not listed, and the
top-level conf/ and tasks/ folders (with whatever packages they grow) install as dgc.conf and dgc.tasks."""

from setuptools import find_packages, setup

TOP_LEVEL = {"dgc.conf": "conf", "dgc.tasks": "tasks"}  # installed name -> folder; the mapping is in pyproject.toml

packages = find_packages(include=["dgc", "dgc.*"])
for name, folder in TOP_LEVEL.items():
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages)
