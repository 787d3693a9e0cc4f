"""Puts deepspeed_zerospeed.pth beside the package, so pip records it and `pip uninstall` removes it
(see zerospeed/compat/startup.py for what it does at interpreter start)."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "deepspeed_zerospeed.pth"


class BuildWithStartupHook(build_py):
    def run(self):
        super().run()
        shutil.copy(Path(__file__).parent / PTH, Path(self.build_lib) / PTH)

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


setup(cmdclass={"build_py": BuildWithStartupHook})
