"""Maps the repository's top-level folders onto the unique import root ``dynamod``.

The tree keeps the layer folders at the top (``shared/``, ``daemon/``, ``console/``) as the design
card asks, while the installed package is ``dynamod.shared``, ``dynamod.daemon`` and
``dynamod.console`` so that no bare top-level ``shared`` module ever lands in site-packages.
"""

from setuptools import find_packages, setup

LAYERS = ("shared", "daemon", "console")

packages = ["dynamod"]
package_dir = {"dynamod": "dynamod"}
for layer in LAYERS:
    package_dir[f"dynamod.{layer}"] = layer
    packages.append(f"dynamod.{layer}")
    packages += [f"dynamod.{layer}.{sub}" for sub in find_packages(layer)]

setup(
    packages=packages,
    package_dir=package_dir,
    package_data={"dynamod.daemon": ["assets/**/*"]},
    include_package_data=True,
)
