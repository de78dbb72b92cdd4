"""Maps the repository's top-level folders onto the unique import root ``dynamod``.

The tree keeps the layer folders at the top (``shared/``, ``daemon/``, ``console/``) as the design
card asks, while the installed package is ``dynamod.shared``, ``dynamod.daemon`` and
``dynamod.console`` so that no bare top-level ``shared`` module ever lands in site-packages.

It also builds the KV index's optional compiled core (``dynamod.shared.kv._kvcore``, plain C
against the CPython API, shared/kv/_native/). Optional because the router works without it: when
no C compiler or Python headers are present the build says why and goes on, and the pure-Python
index and hashing are used (``pip install -e .`` builds it in place, beside its package).
"""

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

LAYERS = ("shared", "daemon", "console")

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
        self.warn(f"dynamod: compiled KV core not built ({exc}); the pure-Python KV index will be used")


kvcore = Extension(
    "dynamod.shared.kv._kvcore",
    sources=["shared/kv/_native/kvcore.c", "shared/kv/_native/schedcore.c"],
    depends=["shared/kv/_native/xxhash.h", "shared/kv/_native/u64map.h"],
    include_dirs=["shared/kv/_native"],
    extra_compile_args=["-O2"],
    optional=True,
)

setup(
    packages=packages,
    package_dir=package_dir,
    package_data={"dynamod.daemon": ["assets/**/*"]},
    include_package_data=True,
    ext_modules=[kvcore],
    cmdclass={"build_ext": OptionalBuildExt},
)
