"""Build hook for the one compiled piece: the residual-capture callback (native/)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "meshnode.executor._capture",
            sources=["native/capture.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror"],
        )
    ]
)
