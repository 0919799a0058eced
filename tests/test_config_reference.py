"""docs/CONFIG.md is what `python -m deploy.config_reference` generates from DeployArgs."""

from pathlib import Path

from deploy.args import DeployArgs
from deploy.config_reference import reference

DOC = Path(__file__).resolve().parents[1] / "docs" / "CONFIG.md"


def test_the_config_reference_is_up_to_date():
    assert DOC.read_text() == reference(), "run: python -m deploy.config_reference > docs/CONFIG.md"


def test_every_field_is_described():
    undescribed = [name for name, field in DeployArgs.model_fields.items() if not field.description]
    assert not undescribed
    assert all(f"`{name}`" in reference() for name in DeployArgs.model_fields)
