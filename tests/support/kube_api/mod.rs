//! A fake of the Kubernetes API server's pod and EndpointSlice endpoints, faithful enough that kube-rs's
//! own client and `kube::runtime::watcher` run against it unchanged: tongs reaches it through a
//! kubeconfig file (cluster `http://127.0.0.1:PORT`, a bearer token), over plain HTTP/1.1 on a real
//! socket.
//!
//! Two resources ([`Resource`]): `v1` `Pod` under `/api/v1` (`pods`), and `discovery.k8s.io/v1`
//! `EndpointSlice` under `/apis/discovery.k8s.io/v1` (`endpointslices`). As in etcd, objects of both
//! share the one global resourceVersion and the one history of changes (each change tagged with its
//! resource); every list, watch and get is scoped to one resource, so a pod change never shows up in
//! a watch of EndpointSlices, nor the reverse.
//!
//! What it covers, in the API server's wire format (JSON, `Status` objects for every error):
//! - `GET /api/v1/pods`, `GET /api/v1/namespaces/{ns}/pods`, and the same for
//!   `/apis/discovery.k8s.io/v1/.../endpointslices`: a `PodList` (`EndpointSliceList`) with
//!   `metadata.resourceVersion`; `labelSelector` (`k=v`, `k==v`, `k!=v`, `k`, `!k`, `k in (a,b)`,
//!   `k notin (a,b)`, comma-joined), `fieldSelector` (`=`, `==`, `!=` on the fields the API server
//!   indexes: for pods `metadata.name`, `metadata.namespace`, `spec.nodeName`, `spec.restartPolicy`,
//!   `spec.schedulerName`, `spec.serviceAccountName`, `spec.hostNetwork`, `status.phase`,
//!   `status.podIP`, `status.nominatedNodeName`; for EndpointSlices only `metadata.name` and
//!   `metadata.namespace`; any other field is a 400 as on a real server);
//!   `limit` + `continue` pagination over a consistent snapshot (a continue token outlives neither
//!   [`Cluster::compact`] nor the last 64 snapshots: 410 `Expired` then, as after etcd compaction);
//!   `resourceVersion` (unset, `0`, or not newer than the current one) with `resourceVersionMatch`.
//! - `GET ...?watch=true`: a chunked stream of JSON lines `{"type": ..., "object": ...}`. From
//!   `resourceVersion=N` it replays the changes to its resource after N from the kept history, then
//!   streams live ones; without one (or `0`) it starts with synthetic `ADDED` events for the current
//!   objects. An N older than the history answers one `ERROR` event with a 410 `Expired` `Status`
//!   ("too old resource version"). Selectors apply to events as on a real server: an object that stops
//!   matching arrives as `DELETED`, one that starts matching as `ADDED`. `allowWatchBookmarks` gets
//!   `BOOKMARK` events (sent by [`Cluster::bookmark`], with the watched resource's kind);
//!   `timeoutSeconds` ends the stream cleanly.
//! - `GET /api/v1/namespaces/{ns}/pods/{name}` and
//!   `GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices/{name}`; unknown objects are a 404
//!   `NotFound`.
//! - `PATCH` of a pod (not of an EndpointSlice) with `application/merge-patch+json`
//!   (RFC 7386; `application/strategic-merge-patch+json` only for `metadata`, where the two agree):
//!   bumps the resourceVersion and emits `MODIFIED`, unless nothing changed; `status` in the patch is
//!   ignored (it is a subresource), `spec` changes are refused (422) as pod updates mostly are, a
//!   `metadata.resourceVersion` or `metadata.uid` in the patch is a precondition (409); unknown pods
//!   are a 404 `NotFound`. Every patch is recorded ([`FakeKubeApi::patches`]).
//! - Test controls ([`Cluster`], through [`FakeKubeApi::atomically`] or the shortcuts on
//!   [`FakeKubeApi`]): create, update, start deleting (`deletionTimestamp`) and delete pods; create,
//!   update and delete EndpointSlices ([`Cluster::create_slice`] and co., [`endpoint_slice`] builds
//!   one as the EndpointSlice controller writes it) or objects of any [`Resource`]
//!   ([`Cluster::create_object`] and co.); each change bumps the one global resourceVersion; drop
//!   every open watch abruptly (the chunked stream is cut without its terminator) or end them cleanly
//!   (as a server-side timeout does); make the next watches answer 410; forget the history
//!   (compaction); make the next lists fail with 500; count lists, watches and patches; record every
//!   request. These controls and [`Stats`] are not per resource: they apply to and count lists and
//!   watches of both.
//!
//! What it does not cover: other resources (Services, Endpoints, nodes, ...), API discovery (`/api`,
//! `/apis`, `/version`), create, update (PUT) and delete through the API, `PATCH` of EndpointSlices
//! (405), `deleteCollection`, subresources (`/status`, `/log`, `/exec`), server-side apply and JSON
//! patch (415), streaming lists (`sendInitialEvents`: 400), list at an exact past resourceVersion (410
//! unless it is the current one), protobuf, TLS and any authentication but one bearer token,
//! admission, defaulting and validation of objects (they are stored as the test writes them, plus the
//! metadata the server owns: uid, resourceVersion, creationTimestamp, managedFields, and
//! `apiVersion`/`kind`), the EndpointSlice controller (slices change only when a test changes them,
//! never from pods), periodic bookmarks, and watch-cache delays (every change is visible at once).
//!
//! Anything it does not implement is never silently ignored: unknown query parameters, paths, media
//! types and features are answered with a `Status` error, printed, and kept in
//! [`FakeKubeApi::unexpected`], which tests check is empty. Bad input never panics the server.

#![allow(dead_code)]

mod cluster;
mod collection;
mod pod;
mod resource;
/// Label and field selectors as the API server reads them; `tests/deploy` checks the manifests' selectors
/// with the same reading.
pub mod selectors;
mod server;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use http::Method;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use cluster::Cluster;
#[allow(unused_imports)] // Not every test binary builds slices.
pub use resource::{Resource, endpoint_slice};

/// Largest request body accepted (the API server's own limit is 3 MiB).
pub(super) const MAX_BODY_BYTES: usize = 3 * 1024 * 1024;
/// Changes kept for watches to resume from, unless a test sets another limit.
pub(super) const DEFAULT_HISTORY: usize = 10_000;
/// Paginated lists whose snapshots are kept for their continue tokens.
pub(super) const KEPT_SNAPSHOTS: usize = 64;
/// The first resourceVersion (an empty cluster's).
pub(super) const FIRST_RESOURCE_VERSION: u64 = 1000;
/// A watch without `timeoutSeconds` ends after this (the API server picks 30 to 60 minutes).
pub(super) const DEFAULT_WATCH_TIMEOUT: Duration = Duration::from_secs(1800);

/// A fake API server on 127.0.0.1; dropping it stops it and cuts its watches.
pub struct FakeKubeApi {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: CancellationToken,
}

pub(super) struct Shared {
    pub(super) token: String,
    pub(super) cluster: Mutex<Cluster>,
}

impl Shared {
    pub(super) fn cluster(&self) -> MutexGuard<'_, Cluster> {
        self.cluster.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Counts of what the server was asked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// List requests, every page counted.
    pub list_requests: u64,
    /// List requests without a continue token: each one starts a complete list.
    pub lists_started: u64,
    /// Lists answered 500 because of [`Cluster::fail_next_lists`].
    pub lists_failed: u64,
    /// Watch requests.
    pub watch_requests: u64,
    /// Watches answered with a 410 `ERROR` event (too old, or [`Cluster::expire_next_watches`]).
    pub watches_expired: u64,
    /// Patch requests.
    pub patch_requests: u64,
    /// Watches whose client is still connected.
    pub open_watches: usize,
}

/// One request as received.
#[derive(Clone, Debug)]
pub struct RecordedRequest {
    pub method: Method,
    pub path: String,
    pub query: Vec<(String, String)>,
}

impl RecordedRequest {
    /// The value of query parameter `name`.
    pub fn param(&self, name: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.as_str())
    }

    pub fn is_watch(&self) -> bool {
        self.param("watch").is_some_and(|w| w == "true" || w == "1")
    }

    /// A list of pods (not of another resource).
    pub fn is_list(&self) -> bool {
        self.method == Method::GET && self.path.ends_with("/pods") && !self.is_watch()
    }

    /// The resource the request's path is about, if the fake serves it.
    pub fn resource(&self) -> Option<Resource> {
        Resource::of_path(&self.path)
    }
}

/// One patch as received, with how it was answered.
#[derive(Clone, Debug)]
pub struct PatchRecord {
    pub namespace: String,
    pub name: String,
    pub content_type: String,
    pub field_manager: Option<String>,
    pub body: Value,
    pub status: u16,
}

impl FakeKubeApi {
    /// Starts the server on an ephemeral port of 127.0.0.1.
    pub async fn start() -> FakeKubeApi {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("fake kube API binds");
        let addr = listener.local_addr().expect("fake kube API address");
        let shared = Arc::new(Shared {
            token: format!("fake-token-{}", addr.port()),
            cluster: Mutex::new(Cluster::new()),
        });
        let stop = CancellationToken::new();
        server::serve(listener, Arc::clone(&shared), stop.clone());
        FakeKubeApi { addr, shared, stop }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The bearer token the server accepts.
    pub fn token(&self) -> &str {
        &self.shared.token
    }

    /// Writes a kubeconfig for this server (its token, `namespace` as the context's) into `dir`.
    pub fn write_kubeconfig(&self, dir: &Path, namespace: &str) -> PathBuf {
        let path = dir.join("kubeconfig");
        let text = format!(
            "apiVersion: v1\nkind: Config\n\
             clusters:\n- name: fake\n  cluster:\n    server: {}\n\
             users:\n- name: tongs\n  user:\n    token: {}\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: tongs\n    namespace: {namespace}\n\
             current-context: fake\n",
            self.url(),
            self.shared.token
        );
        std::fs::write(&path, text).expect("kubeconfig written");
        path
    }

    /// Runs `f` on the cluster under its lock: everything it does is seen by clients at once, and no
    /// request is handled in between.
    pub fn atomically<R>(&self, f: impl FnOnce(&mut Cluster) -> R) -> R {
        f(&mut self.shared.cluster())
    }

    pub fn create(&self, pod: Value) -> u64 {
        self.atomically(|c| c.create(pod))
    }

    pub fn update(&self, namespace: &str, name: &str, change: impl FnOnce(&mut Value)) -> u64 {
        self.atomically(|c| c.update(namespace, name, change))
    }

    pub fn begin_deletion(&self, namespace: &str, name: &str) -> u64 {
        self.atomically(|c| c.begin_deletion(namespace, name))
    }

    pub fn delete(&self, namespace: &str, name: &str) -> u64 {
        self.atomically(|c| c.delete(namespace, name))
    }

    pub fn pod(&self, namespace: &str, name: &str) -> Option<Value> {
        self.atomically(|c| c.pod(namespace, name))
    }

    pub fn create_slice(&self, slice: Value) -> u64 {
        self.atomically(|c| c.create_slice(slice))
    }

    pub fn update_slice(
        &self,
        namespace: &str,
        name: &str,
        change: impl FnOnce(&mut Value),
    ) -> u64 {
        self.atomically(|c| c.update_slice(namespace, name, change))
    }

    pub fn delete_slice(&self, namespace: &str, name: &str) -> u64 {
        self.atomically(|c| c.delete_slice(namespace, name))
    }

    pub fn slice(&self, namespace: &str, name: &str) -> Option<Value> {
        self.atomically(|c| c.slice(namespace, name))
    }

    pub fn drop_watches(&self) -> usize {
        self.atomically(Cluster::drop_watches)
    }

    pub fn end_watches(&self) -> usize {
        self.atomically(Cluster::end_watches)
    }

    pub fn expire_next_watches(&self, count: u64) {
        self.atomically(|c| c.expire_next_watches(count));
    }

    pub fn compact(&self) {
        self.atomically(Cluster::compact);
    }

    pub fn fail_next_lists(&self, count: u64) {
        self.atomically(|c| c.fail_next_lists(count));
    }

    pub fn heal_lists(&self) {
        self.atomically(Cluster::heal_lists);
    }

    pub fn bookmark(&self) -> usize {
        self.atomically(Cluster::bookmark)
    }

    pub fn resource_version(&self) -> u64 {
        self.atomically(|c| c.resource_version())
    }

    pub fn stats(&self) -> Stats {
        self.atomically(|c| c.stats())
    }

    pub fn patches(&self) -> Vec<PatchRecord> {
        self.atomically(|c| c.patches.clone())
    }

    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.atomically(|c| c.requests.clone())
    }

    /// What the server was asked that it does not implement (should be empty).
    pub fn unexpected(&self) -> Vec<String> {
        self.atomically(|c| c.unexpected.clone())
    }

    /// Forgets the recorded unexpected requests (for a test that provokes them on purpose).
    pub fn clear_unexpected(&self) {
        self.atomically(|c| c.unexpected.clear());
    }
}

impl Drop for FakeKubeApi {
    fn drop(&mut self) {
        self.stop.cancel();
        self.atomically(Cluster::drop_watches);
    }
}
