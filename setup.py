"""Build hook for the compiled pieces (native/): the residual-capture callback and the between-steps linger."""

from setuptools import Extension, setup

FLAGS = ["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror"]

setup(
    ext_modules=[
        Extension(
            "meshnode.executor._capture",
            sources=["native/capture.c"],
            extra_compile_args=FLAGS,
        ),
        Extension("meshnode.executor._linger", sources=["native/linger.c"], extra_compile_args=FLAGS,
                  extra_link_args=["-pthread"]),
    ]
)
