# A CPU image that serves an exported artifact through ONNX Runtime (the core package + `serve`; no torch):
#   docker build -t unispec .
#   docker run -v $PWD/art:/artifact:ro -p 8000:8000 unispec serve /artifact --host 0.0.0.0
# Structured output (json_schema / regex / grammar requests) needs the `structured` extra, whose xgrammar
# requires torch: `docker build --build-arg EXTRAS=serve,structured -t unispec .` adds torch's CPU wheel.
# Never built or run here: the development machines have the docker client but no daemon.
FROM python:3.11-slim

# g++: the native ONNX Runtime CPU kernels are compiled on first use, for the CPU that runs the container
# (the ISA variant its flags allow), so the compiler ships in the image; the build lands in $UNISPEC_CACHE.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

ARG EXTRAS=serve
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    UNISPEC_CACHE=/cache

WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY unispec unispec
COPY export export
COPY runtime runtime
COPY plugins plugins
COPY engines engines
# An extra that needs torch gets its CPU build first: PyPI's torch==2.13.0 is the CUDA 13 build (gigabytes).
RUN case ",${EXTRAS}," in \
      *,structured,*|*,export,*|*,bench,*) \
        pip install "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu ;; \
    esac \
    && pip install ".[${EXTRAS}]" \
    && rm -rf /src

RUN useradd --create-home unispec && mkdir /cache && chown unispec /cache
USER unispec
WORKDIR /home/unispec
EXPOSE 8000
ENTRYPOINT ["unispec"]
CMD ["--help"]
