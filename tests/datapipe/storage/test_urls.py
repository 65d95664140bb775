import pytest

from datapipe import expand_urls, redact_url


def test_brace_ranges_lists_and_joins():
    assert expand_urls("d/s-{00..02}.tar") == ["d/s-00.tar", "d/s-01.tar", "d/s-02.tar"]
    assert expand_urls("a/{x,y}.tar::s3://b/c-{1..2}.tar") == ["a/x.tar", "a/y.tar", "s3://b/c-1.tar", "s3://b/c-2.tar"]
    assert expand_urls(["file:///x/{a,b}.tar", "https://h/p.tar"]) == ["file:///x/a.tar", "file:///x/b.tar",
                                                                    "https://h/p.tar"]


@pytest.mark.parametrize("spec", ["", "  ", "a::", "x{1..", "x}{", "x{9..1}.tar", "x{a..bb}.tar"])
def test_malformed_specs_are_value_errors(spec):
    with pytest.raises(ValueError):
        expand_urls(spec)


def test_wrong_types():
    with pytest.raises(ValueError):
        expand_urls(3)
    with pytest.raises(ValueError):
        expand_urls(["ok.tar", None])


def test_pipe_refused_unless_allowed():
    with pytest.raises(ValueError, match="allow_pipe"):
        expand_urls("pipe:curl -s http://x/{0..1}.tar")
    assert expand_urls("pipe:cat {a,b}.tar", allow_pipe=True) == ["pipe:cat a.tar", "pipe:cat b.tar"]


def test_redaction_hides_credentials():
    url = "https://alice:s3cret@host/p/s.tar?X-Amz-Signature=abc&X-Amz-Credential=k&part=1"
    red = redact_url(url)
    assert "s3cret" not in red and "abc" not in red and "=k" not in red
    assert "alice" in red and "part=1" in red and "host/p/s.tar" in red
    assert redact_url("/local/path.tar") == "/local/path.tar"


def test_errors_never_show_credentials():
    with pytest.raises(ValueError) as info:
        expand_urls("https://u:topsecret@h/x{1..")
    assert "topsecret" not in str(info.value)
