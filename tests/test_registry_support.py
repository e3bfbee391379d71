"""The test registry itself: a real docker-registry that answers /v2/ anonymously, or only with basic auth."""
import base64
import urllib.error
import urllib.request

import pytest


def test_anonymous_registry_answers_v2(registry):
    with urllib.request.urlopen(registry.url + "/v2/") as resp:
        assert resp.status == 200
    assert registry.storage.is_dir()


def test_auth_registry_wants_basic_credentials(auth_registry):
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(auth_registry.url + "/v2/")
    assert err.value.code == 401
    assert err.value.headers["WWW-Authenticate"].startswith("Basic ")
    (user, password), = auth_registry.users.items()
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    req = urllib.request.Request(auth_registry.url + "/v2/", headers={"Authorization": "Basic " + token})
    with urllib.request.urlopen(req) as resp:
        assert resp.status == 200
