//! The fake cluster's state: objects by resource (pods, EndpointSlices), the one resourceVersion and
//! the one history watches resume from (as etcd keeps them for every resource), the open watches, and
//! the test controls that change them.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::resource::Resource;
use super::selectors::{FieldSelector, LabelSelector};
use super::{DEFAULT_HISTORY, FIRST_RESOURCE_VERSION, PatchRecord, RecordedRequest, Stats};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ChangeKind {
    Added,
    Modified,
    Deleted,
}

/// One change to an object, as the history keeps it for watches.
pub(super) struct Change {
    pub(super) resource: Resource,
    pub(super) resource_version: u64,
    pub(super) kind: ChangeKind,
    /// The object before the change (for a watch to tell "stopped matching" from "never matched").
    pub(super) before: Option<Value>,
    /// The object after the change (for a deletion: its last state, at the deletion's resourceVersion).
    pub(super) after: Value,
}

pub(super) enum WatchFrame {
    Line(Bytes),
    /// Cut the connection without ending the chunked stream.
    Abort,
}

/// What a watch or list is about.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Scope {
    pub(super) resource: Resource,
    pub(super) namespace: Option<String>,
    pub(super) labels: LabelSelector,
    pub(super) fields: FieldSelector,
}

impl Scope {
    /// Whether an object of this scope's resource is in it.
    pub(super) fn matches(&self, object: &Value) -> bool {
        self.namespace
            .as_deref()
            .is_none_or(|ns| text(object, &["metadata", "namespace"]) == ns)
            && self.labels.matches(object)
            && self.fields.matches(object)
    }
}

pub(super) struct Watch {
    pub(super) scope: Scope,
    pub(super) bookmarks: bool,
    pub(super) sender: mpsc::UnboundedSender<WatchFrame>,
}

/// A paginated list's items, kept for its continue tokens.
pub(super) struct Snapshot {
    pub(super) id: u64,
    pub(super) resource_version: u64,
    pub(super) scope: Scope,
    pub(super) items: Arc<Vec<Value>>,
}

/// The fake cluster's state: objects, history, open watches, and the test controls.
pub struct Cluster {
    pub(super) resource_version: u64,
    /// By resource, then (namespace, name): the key order etcd lists in.
    pub(super) objects: BTreeMap<Resource, BTreeMap<(String, String), Value>>,
    pub(super) history: VecDeque<Change>,
    pub(super) history_limit: usize,
    /// Every change after this resourceVersion is in `history`; a watch may start from here on.
    pub(super) compacted: u64,
    pub(super) watches: Vec<Watch>,
    pub(super) snapshots: VecDeque<Snapshot>,
    pub(super) next_id: u64,
    pub(super) lists_to_fail: u64,
    pub(super) watches_to_expire: u64,
    pub(super) stats: Stats,
    pub(super) patches: Vec<PatchRecord>,
    pub(super) requests: Vec<RecordedRequest>,
    pub(super) unexpected: Vec<String>,
}

impl Cluster {
    pub(super) fn new() -> Cluster {
        Cluster {
            resource_version: FIRST_RESOURCE_VERSION,
            objects: BTreeMap::new(),
            history: VecDeque::new(),
            history_limit: DEFAULT_HISTORY,
            compacted: FIRST_RESOURCE_VERSION,
            watches: Vec::new(),
            snapshots: VecDeque::new(),
            next_id: 1,
            lists_to_fail: 0,
            watches_to_expire: 0,
            stats: Stats::default(),
            patches: Vec::new(),
            requests: Vec::new(),
            unexpected: Vec::new(),
        }
    }

    /// The current resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.resource_version
    }

    /// Creates a pod (a JSON object with at least `metadata.name`; `metadata.namespace` defaults to
    /// `default`), filling in what the server owns; emits `ADDED`. Panics if it exists: a test's error.
    pub fn create(&mut self, pod: Value) -> u64 {
        self.create_object(Resource::Pods, pod)
    }

    /// Changes pod `namespace/name` with `change`, keeping what the server owns; emits `MODIFIED`
    /// unless nothing changed. Panics if there is no such pod.
    pub fn update(&mut self, namespace: &str, name: &str, change: impl FnOnce(&mut Value)) -> u64 {
        self.update_object(Resource::Pods, namespace, name, change)
    }

    /// Starts deleting a pod, as `DELETE` with a grace period does: `deletionTimestamp` is set to when
    /// the grace period ends (30 s from now) and the pod stays until [`Cluster::delete`] (the kubelet
    /// confirming). Emits `MODIFIED`.
    pub fn begin_deletion(&mut self, namespace: &str, name: &str) -> u64 {
        self.update(namespace, name, |pod| {
            if let Some(metadata) = pod.get_mut("metadata").and_then(Value::as_object_mut) {
                metadata.insert("deletionTimestamp".into(), json!(timestamp_in(30)));
                metadata.insert("deletionGracePeriodSeconds".into(), json!(30));
            }
        })
    }

    /// Removes a pod; emits `DELETED` with its last state. Panics if there is no such pod.
    pub fn delete(&mut self, namespace: &str, name: &str) -> u64 {
        self.delete_object(Resource::Pods, namespace, name)
    }

    /// A pod as stored.
    pub fn pod(&self, namespace: &str, name: &str) -> Option<Value> {
        self.object(Resource::Pods, namespace, name)
    }

    /// Creates an EndpointSlice (see [`super::endpoint_slice`]), as [`Cluster::create`] does a pod.
    pub fn create_slice(&mut self, slice: Value) -> u64 {
        self.create_object(Resource::EndpointSlices, slice)
    }

    /// Changes EndpointSlice `namespace/name`, as [`Cluster::update`] does a pod.
    pub fn update_slice(
        &mut self,
        namespace: &str,
        name: &str,
        change: impl FnOnce(&mut Value),
    ) -> u64 {
        self.update_object(Resource::EndpointSlices, namespace, name, change)
    }

    /// Removes an EndpointSlice; emits `DELETED`. Panics if there is no such slice.
    pub fn delete_slice(&mut self, namespace: &str, name: &str) -> u64 {
        self.delete_object(Resource::EndpointSlices, namespace, name)
    }

    /// An EndpointSlice as stored.
    pub fn slice(&self, namespace: &str, name: &str) -> Option<Value> {
        self.object(Resource::EndpointSlices, namespace, name)
    }

    /// Creates an object of `resource` (a JSON object with at least `metadata.name`;
    /// `metadata.namespace` defaults to `default`), filling in what the server owns (uid,
    /// creationTimestamp, managedFields, resourceVersion, and `apiVersion`/`kind` as the server returns
    /// them); emits `ADDED`. Returns the new resourceVersion. Panics if it exists: a test's error.
    pub fn create_object(&mut self, resource: Resource, mut object: Value) -> u64 {
        let kind = resource.kind();
        let Some(metadata) = object.get_mut("metadata").and_then(Value::as_object_mut) else {
            panic!("fake kube API: a {kind} needs metadata.name: {object}");
        };
        metadata
            .entry("namespace")
            .or_insert_with(|| json!("default"));
        let id = self.next_id;
        self.next_id += 1;
        metadata.insert(
            "uid".into(),
            json!(format!("00000000-0000-4000-8000-{id:012x}")),
        );
        metadata.insert("creationTimestamp".into(), json!(timestamp()));
        metadata.insert(
            "managedFields".into(),
            json!([{
                "manager": "fake-kube-api", "operation": "Update",
                "apiVersion": resource.api_version(),
                "time": timestamp(), "fieldsType": "FieldsV1", "fieldsV1": {"f:metadata": {}}
            }]),
        );
        let key = key_of(&object);
        assert!(
            !key.1.is_empty(),
            "fake kube API: a {kind} needs metadata.name"
        );
        assert!(
            self.object(resource, &key.0, &key.1).is_none(),
            "fake kube API: {kind} {}/{} exists already",
            key.0,
            key.1
        );
        if let Some(fields) = object.as_object_mut() {
            fields.insert("apiVersion".into(), json!(resource.api_version()));
            fields.insert("kind".into(), json!(kind));
        }
        self.commit(resource, ChangeKind::Added, None, object)
    }

    /// Changes object `namespace/name` of `resource` with `change`, keeping what the server owns; emits
    /// `MODIFIED` unless nothing changed. Panics if there is no such object.
    pub fn update_object(
        &mut self,
        resource: Resource,
        namespace: &str,
        name: &str,
        change: impl FnOnce(&mut Value),
    ) -> u64 {
        let Some(before) = self.object(resource, namespace, name) else {
            panic!(
                "fake kube API: no {} {namespace}/{name} to update",
                resource.kind()
            );
        };
        let mut after = before.clone();
        change(&mut after);
        keep_server_fields(&before, &mut after);
        if after == before {
            return self.resource_version;
        }
        self.commit(resource, ChangeKind::Modified, Some(before), after)
    }

    /// Removes an object of `resource`; emits `DELETED` with its last state. Panics if there is none.
    pub fn delete_object(&mut self, resource: Resource, namespace: &str, name: &str) -> u64 {
        let Some(before) = self.object(resource, namespace, name) else {
            panic!(
                "fake kube API: no {} {namespace}/{name} to delete",
                resource.kind()
            );
        };
        self.commit(resource, ChangeKind::Deleted, Some(before.clone()), before)
    }

    /// An object as stored.
    pub fn object(&self, resource: Resource, namespace: &str, name: &str) -> Option<Value> {
        self.objects
            .get(&resource)?
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned()
    }

    /// The stored objects of `resource`, in key order (namespace, name).
    pub(super) fn objects_of(&self, resource: Resource) -> impl Iterator<Item = &Value> {
        self.objects
            .get(&resource)
            .into_iter()
            .flat_map(BTreeMap::values)
    }

    /// Cuts every open watch connection abruptly (no chunked terminator), as a lost connection or a
    /// restarting API server does. Returns how many there were.
    pub fn drop_watches(&mut self) -> usize {
        let watches = std::mem::take(&mut self.watches);
        let open = watches.iter().filter(|w| !w.sender.is_closed()).count();
        for watch in watches {
            let _ = watch.sender.send(WatchFrame::Abort);
        }
        open
    }

    /// Ends every open watch cleanly, as the server does when `timeoutSeconds` runs out.
    pub fn end_watches(&mut self) -> usize {
        let open = self
            .watches
            .iter()
            .filter(|w| !w.sender.is_closed())
            .count();
        self.watches.clear();
        open
    }

    /// The next `count` watches answer a 410 `Expired` `ERROR` event whatever their resourceVersion.
    pub fn expire_next_watches(&mut self, count: u64) {
        self.watches_to_expire = count;
    }

    /// Forgets the history (as etcd compaction does): a watch from any resourceVersion but the current
    /// one answers 410, and continue tokens of older lists expire.
    pub fn compact(&mut self) {
        self.history.clear();
        self.compacted = self.resource_version;
        let compacted = self.compacted;
        self.snapshots.retain(|s| s.resource_version >= compacted);
    }

    /// Keeps at most `limit` changes for watches to resume from.
    pub fn set_history_limit(&mut self, limit: usize) {
        self.history_limit = limit;
        self.trim_history();
    }

    /// The next `count` list requests answer 500 (`u64::MAX`: until [`Cluster::heal_lists`]).
    pub fn fail_next_lists(&mut self, count: u64) {
        self.lists_to_fail = count;
    }

    /// Lists succeed again.
    pub fn heal_lists(&mut self) {
        self.lists_to_fail = 0;
    }

    /// Sends a `BOOKMARK` at the current resourceVersion to every watch that allowed bookmarks (of any
    /// resource, each with its own kind).
    pub fn bookmark(&mut self) -> usize {
        let version = self.resource_version.to_string();
        let mut sent = 0;
        self.watches.retain(|watch| {
            if !watch.bookmarks {
                return true;
            }
            sent += 1;
            let resource = watch.scope.resource;
            let line = event_line(
                "BOOKMARK",
                &json!({
                    "kind": resource.kind(), "apiVersion": resource.api_version(),
                    "metadata": {"resourceVersion": version}
                }),
            );
            watch.sender.send(WatchFrame::Line(line)).is_ok()
        });
        sent
    }

    pub fn stats(&self) -> Stats {
        Stats {
            open_watches: self
                .watches
                .iter()
                .filter(|w| !w.sender.is_closed())
                .count(),
            ..self.stats
        }
    }

    /// Records a change, keeps it for watches and sends it to the open ones. Returns its version.
    pub(super) fn commit(
        &mut self,
        resource: Resource,
        kind: ChangeKind,
        before: Option<Value>,
        mut after: Value,
    ) -> u64 {
        self.resource_version += 1;
        let version = self.resource_version;
        if let Some(metadata) = after.get_mut("metadata").and_then(Value::as_object_mut) {
            metadata.insert("resourceVersion".into(), json!(version.to_string()));
        }
        let key = key_of(&after);
        let store = self.objects.entry(resource).or_default();
        match kind {
            ChangeKind::Deleted => {
                store.remove(&key);
            }
            ChangeKind::Added | ChangeKind::Modified => {
                store.insert(key, after.clone());
            }
        }
        let change = Change {
            resource,
            resource_version: version,
            kind,
            before,
            after,
        };
        self.watches
            .retain(|watch| match event_for(&watch.scope, &change) {
                Some(line) => watch.sender.send(WatchFrame::Line(line)).is_ok(),
                None => !watch.sender.is_closed(),
            });
        self.history.push_back(change);
        self.trim_history();
        version
    }

    pub(super) fn trim_history(&mut self) {
        while self.history.len() > self.history_limit {
            if let Some(dropped) = self.history.pop_front() {
                self.compacted = dropped.resource_version;
            }
        }
    }

    pub(super) fn unexpected(&mut self, what: String) {
        eprintln!("fake kube API: UNEXPECTED: {what}");
        self.unexpected.push(what);
    }
}

/// The watch event a change makes for a watch of `scope`, as a JSON line (none if it does not see it).
pub(super) fn event_for(scope: &Scope, change: &Change) -> Option<Bytes> {
    if change.resource != scope.resource {
        return None;
    }
    let now = scope.matches(&change.after);
    let was = change.before.as_ref().is_some_and(|b| scope.matches(b));
    let kind = match change.kind {
        ChangeKind::Added if now => "ADDED",
        ChangeKind::Modified if was && now => "MODIFIED",
        ChangeKind::Modified if now => "ADDED",
        ChangeKind::Modified if was => "DELETED",
        ChangeKind::Deleted if was => "DELETED",
        _ => return None,
    };
    Some(event_line(kind, &change.after))
}

pub(super) fn event_line(kind: &str, object: &Value) -> Bytes {
    let mut line = json!({"type": kind, "object": object}).to_string();
    line.push('\n');
    Bytes::from(line)
}

pub(super) fn key_of(object: &Value) -> (String, String) {
    (
        text(object, &["metadata", "namespace"]).to_owned(),
        text(object, &["metadata", "name"]).to_owned(),
    )
}

/// The string at `path` in `value`, or "".
pub(super) fn text<'a>(value: &'a Value, path: &[&str]) -> &'a str {
    path.iter()
        .try_fold(value, |v, key| v.get(key))
        .and_then(Value::as_str)
        .unwrap_or("")
}

/// Restores what the server owns (identity, timestamps, kind) from `before` into `after`.
pub(super) fn keep_server_fields(before: &Value, after: &mut Value) {
    for field in ["apiVersion", "kind"] {
        if let (Some(value), Some(object)) = (before.get(field), after.as_object_mut()) {
            object.insert(field.into(), value.clone());
        }
    }
    let Some(old) = before.get("metadata").and_then(Value::as_object) else {
        return;
    };
    if !after.get("metadata").is_some_and(Value::is_object)
        && let Some(object) = after.as_object_mut()
    {
        object.insert("metadata".into(), json!({}));
    }
    if let Some(metadata) = after.get_mut("metadata").and_then(Value::as_object_mut) {
        for field in [
            "name",
            "namespace",
            "uid",
            "creationTimestamp",
            "resourceVersion",
            "managedFields",
        ] {
            match old.get(field) {
                Some(value) => metadata.insert(field.into(), value.clone()),
                None => metadata.remove(field),
            };
        }
    }
}

/// RFC 3339 UTC time, as Kubernetes writes it.
pub(super) fn timestamp() -> String {
    timestamp_in(0)
}

/// [`timestamp`] `seconds` from now.
pub(super) fn timestamp_in(seconds: u64) -> String {
    let seconds = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
        + seconds;
    let (days, rest) = (seconds / 86_400, seconds % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let mp = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
}
