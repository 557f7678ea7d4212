"""Build and install minengine and triton_kernels.

``pip install -e .`` installs both packages; ``pip install -e ".[test]"`` adds the test tools.
The CUDA C++ kernels in csrc/ (built into ``minengine._C`` with nvcc) arrive with their own
issue; until then the package is pure Python.
"""

from setuptools import find_packages, setup

setup(
    name="minengine",
    version="0.1.0",
    description="Hand-written paged-attention kernels with a minimal LLM serving engine on top",
    python_requires=">=3.10",
    packages=find_packages(include=["minengine", "minengine.*", "triton_kernels", "triton_kernels.*"]),
    install_requires=[
        "torch>=2.11",
        "triton>=3.6",
        "numpy",
        "safetensors",
        "tokenizers>=0.19",
        "jinja2>=3.1",  # chat templates, rendered as transformers renders them
        "tqdm",
        "fastapi",
        "uvicorn",
        "pyzmq",
        "prometheus-client",
    ],
    extras_require={
        "test": ["pytest>=8", "ruff>=0.6", "transformers>=4.51", "openai>=1.40", "httpx", "matplotlib"],
        "bench": ["nvidia-ml-py", "httpx", "matplotlib"],
    },
)
