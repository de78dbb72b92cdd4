"""Maps the repository's top-level folders onto the unique import root ``dynamod``.

The tree keeps the layer folders at the top (``shared/``, ``daemon/``, ``console/``) as the design
card asks, while the installed package is ``dynamod.shared``, ``dynamod.daemon`` and
``dynamod.console`` so that no bare top-level ``shared`` module ever lands in site-packages.

It also builds two optional compiled cores, plain C against the CPython API: the KV index and
block hashing (``dynamod.shared.kv._kvcore``, shared/kv/_native/) and the router's per-decision
scheduler loops (``dynamod.daemon.router.core._schedcore``, daemon/router/core/_native/). Optional
because the router works without them: when no C compiler or Python headers are present the build
says why and goes on, and the pure-Python twins are used (``pip install -e .`` builds them in
place, beside their packages).
``DYN_REQUIRE_NATIVE=1`` (CI sets it) makes a failed compile fail the build instead, so a C error
cannot pass as a quiet fallback that merely skips the native tests.
"""

import os

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

LAYERS = ("shared", "daemon", "console")
# The same switch makes ``dynamod.shared.kv.native`` refuse to run without the core.
REQUIRE_NATIVE = os.environ.get("DYN_REQUIRE_NATIVE", "").strip() == "1"

packages = ["dynamod"]
package_dir = {"dynamod": "dynamod"}
for layer in LAYERS:
    package_dir[f"dynamod.{layer}"] = layer
    packages.append(f"dynamod.{layer}")
    packages += [f"dynamod.{layer}.{sub}" for sub in find_packages(layer)]


class OptionalBuildExt(build_ext):
    """Builds the compiled core if it can; a failure falls back to pure Python, not a failed install."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # no compiler at all (distutils raises several unrelated types)
            self._fallback(exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # a compiler that fails on this platform
            self._fallback(exc)

    def _fallback(self, exc: Exception) -> None:
        if REQUIRE_NATIVE:
            raise RuntimeError(f"dynamod: compiled core not built and DYN_REQUIRE_NATIVE=1: {exc}") from exc
        self.warn(f"dynamod: compiled core not built ({exc}); its pure-Python twin will be used")


kvcore = Extension(
    "dynamod.shared.kv._kvcore",
    sources=["shared/kv/_native/kvcore.c"],
    depends=["shared/kv/_native/vendor/xxhash.h", "shared/kv/_native/u64map.h"],
    include_dirs=["shared/kv/_native"],
    extra_compile_args=["-O2"],
    optional=not REQUIRE_NATIVE,
)

schedcore = Extension(
    "dynamod.daemon.router.core._schedcore",
    sources=["daemon/router/core/_native/schedcore.c"],
    depends=["shared/kv/_native/u64map.h"],
    include_dirs=["shared/kv/_native"],
    extra_compile_args=["-O2"],
    optional=not REQUIRE_NATIVE,
)

setup(
    packages=packages,
    package_dir=package_dir,
    package_data={"dynamod.daemon": ["assets/**/*"]},
    include_package_data=True,
    ext_modules=[kvcore, schedcore],
    cmdclass={"build_ext": OptionalBuildExt},
)
