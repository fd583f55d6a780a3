"""The one C extension; everything else about the package is in pyproject.toml.

``runtime/dataplane/_fastpath.c`` fuses the data plane's copy/receive with its xxh3 checksum.
It is optional: with no C compiler or no xxhash headers (Debian's ``libxxhash-dev``, which
``bin/setup`` installs) the install still succeeds and the readers use the pure-Python path
(same digests, slower).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "runtime.dataplane._fastpath",
            sources=["runtime/dataplane/_fastpath.c"],
            libraries=["xxhash"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
