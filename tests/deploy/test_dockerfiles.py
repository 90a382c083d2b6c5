"""The images' Dockerfiles, parsed by BuildKit's own parser (the `dockerfile` package) and checked for
what would break a build or a cluster: unknown instructions, missing build context, root users."""

from __future__ import annotations

import fnmatch

import dockerfile
import pytest
from deploy_tools import REPO

IMAGES = ["planner", "worker", "operator"]
INSTRUCTIONS = {
    "ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK", "LABEL",
    "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR",
}  # fmt: skip


def parse(image: str) -> tuple[dockerfile.Command, ...]:
    return dockerfile.parse_file(str(REPO / "docker" / f"{image}.Dockerfile"))


def stages(commands: tuple[dockerfile.Command, ...]) -> list[str]:
    return [c.value[2].lower() if len(c.value) > 2 else "" for c in commands if c.cmd == "FROM"]


@pytest.mark.parametrize("image", IMAGES)
def test_dockerfile_parses_with_known_instructions_only(image: str) -> None:
    commands = parse(image)
    assert commands, f"{image}.Dockerfile is empty"
    assert {c.cmd for c in commands} <= INSTRUCTIONS
    first = next(c for c in commands if c.cmd != "ARG")
    assert first.cmd == "FROM"


@pytest.mark.parametrize("image", IMAGES)
def test_base_image_args_are_declared_before_use(image: str) -> None:
    commands = parse(image)
    declared = {
        c.value[0].split("=")[0]
        for c in commands[: [c.cmd for c in commands].index("FROM")]
        if c.cmd == "ARG"
    }
    for c in commands:
        if c.cmd == "FROM" and "${" in c.value[0]:
            used = c.value[0].split("${")[1].split("}")[0]
            assert used in declared, f"{image}: FROM uses ${{{used}}} declared after the first FROM"


@pytest.mark.parametrize("image", IMAGES)
def test_copy_from_names_an_earlier_stage(image: str) -> None:
    commands = parse(image)
    seen: list[str] = []
    for c in commands:
        if c.cmd == "FROM":
            seen.append(c.value[2].lower() if len(c.value) > 2 else "")
        for flag in c.flags:
            if c.cmd == "COPY" and flag.startswith("--from="):
                assert flag.split("=", 1)[1] in seen[:-1], f"{image}: {c.original}"


def _ignored(path: str, patterns: list[str]) -> bool:
    """.dockerignore semantics: the last matching pattern wins; `!` re-includes."""
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        p = pattern[1:] if negate else pattern
        if (
            fnmatch.fnmatch(path, p.rstrip("/"))
            or fnmatch.fnmatch(path, p.rstrip("/") + "/*")
            or (p.endswith("/") and path.startswith(p))
        ):
            ignored = not negate
    return ignored


@pytest.mark.parametrize("image", IMAGES)
def test_copied_sources_exist_and_are_not_excluded_from_the_context(image: str) -> None:
    ignore = REPO / "docker" / f"{image}.Dockerfile.dockerignore"
    patterns = [
        line.strip()
        for line in ignore.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for c in parse(image):
        if c.cmd != "COPY" or any(f.startswith("--from=") for f in c.flags):
            continue
        for src in c.value[:-1]:
            if "*" in src:
                continue  # optional files (README.md*) may be absent
            assert (REPO / src).exists(), f"{image}: COPY {src} is not in the repository"
            assert not _ignored(src.rstrip("/"), patterns), f"{image}: COPY {src} is .dockerignored"


@pytest.mark.parametrize("image", IMAGES)
def test_final_stage_runs_as_a_non_root_user_matching_the_chart(image: str) -> None:
    commands = parse(image)
    last_from = max(i for i, c in enumerate(commands) if c.cmd == "FROM")
    users = [c.value[0] for c in commands[last_from:] if c.cmd == "USER"]
    assert users == ["10001:10001"]


@pytest.mark.parametrize("image", IMAGES)
def test_entrypoint_is_in_exec_form(image: str) -> None:
    entry = [c for c in parse(image) if c.cmd == "ENTRYPOINT"]
    assert len(entry) == 1 and entry[0].json, "a shell-form ENTRYPOINT would swallow SIGTERM"


def test_worker_builds_on_cuda_with_a_compiler_for_triton() -> None:
    commands = parse("worker")
    args = {
        c.value[0].split("=")[0]: c.value[0].split("=", 1)[1]
        for c in commands
        if c.cmd == "ARG" and "=" in c.value[0]
    }
    assert args["CUDA_IMAGE"].startswith("nvidia/cuda:")
    last_from = max(i for i, c in enumerate(commands) if c.cmd == "FROM")
    assert commands[last_from].value[0] == "${CUDA_IMAGE}"
    final_runs = " ".join(" ".join(c.value) for c in commands[last_from:] if c.cmd == "RUN")
    assert "gcc" in final_runs and "python3-dev" in final_runs
    assert "torch==${TORCH_VERSION}" in " ".join(
        " ".join(c.value) for c in commands if c.cmd == "RUN"
    )


def test_operator_image_installs_the_operator_extra_from_pyproject() -> None:
    runs = " ".join(" ".join(c.value) for c in parse("operator") if c.cmd == "RUN")
    assert "['optional-dependencies']['operator']" in runs
    assert "pip install --no-deps ." in runs
    assert "torch" not in runs


def test_chart_and_compose_use_ports_the_images_expose() -> None:
    exposed = {
        image: {p for c in parse(image) if c.cmd == "EXPOSE" for p in c.value} for image in IMAGES
    }
    assert exposed["planner"] == {"50051", "9090"}
    assert exposed["worker"] == {"9091"}
    assert exposed["operator"] == {"8080"}
    cmd = next(c for c in parse("operator") if c.cmd == "ENTRYPOINT").value
    assert "--liveness=http://0.0.0.0:8080/healthz" in cmd
    assert cmd[0] == "kopf"
