"""Package layout: `mrl/` is the library; `kernels/` installs as `mrl_kernels`.

The kernels directory cannot be imported as plain `kernels`: transformers probes for a Hub
package of that name and would pick ours up.
"""
from setuptools import find_packages, setup

kernel_packages = ["mrl_kernels"] + [f"mrl_kernels.{p}" for p in find_packages("kernels")]
setup(
    packages=find_packages(include=["mrl", "mrl.*"]) + kernel_packages,
    package_dir={"mrl_kernels": "kernels"},
    package_data={"mrl.config": ["verl_keys.toml", "verl_defaults.json"]},   # the verl key table (mrl convert)
)
